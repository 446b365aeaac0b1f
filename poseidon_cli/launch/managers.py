"""Where this process stands in a job that a cluster manager started: read from its environment.

Each manager tells every process it starts its rank and the job's size in variables of its own:

* SLURM (``srun``): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID and the step's
  node list (SLURM_STEP_NODELIST / SLURM_NODELIST, compressed as ``node[01-03,07],gpu5``);
* Open MPI (``mpirun``): OMPI_COMM_WORLD_RANK / SIZE / LOCAL_RANK / LOCAL_SIZE;
* MPICH and Intel MPI (Hydra): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS;
* torchrun's convention, which Kubernetes operators also set: RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, GROUP_RANK (the node), MASTER_ADDR, MASTER_PORT.

A Kubeflow PyTorchJob with ``nprocPerNode`` starts one process per pod (a node) and sets
PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE for torchrun to read; there Poseidon plays
torchrun's part: this process starts the node's workers (``NodePlacement``).

What is not here: the rendezvous (rendezvous.py), where rank 0 collects every worker's
address. Here only its address: MASTER_ADDR:MASTER_PORT when set, else the first node of a
SLURM step, else this machine when every rank runs on it. A variable that is present but wrong
is one error line naming it and its value.
"""
from __future__ import annotations

import os
import re
import socket
import zlib
from dataclasses import dataclass
from typing import Mapping

from engine.comm.errors import CommError

#: torchrun's default MASTER_PORT, for a manager that names no port
DEFAULT_MASTER_PORT = 29500
#: a port derived from a job's id lies here: below the range workers probe for their own ports
#: (hosts.reserve_ports: 20000..32000), so two jobs on one node rarely meet and never a worker
DERIVED_PORTS = (12000, 20000)


class ManagerError(CommError, ValueError):
    """A manager's variable that cannot be used; the message names it and its value."""


@dataclass(frozen=True)
class Placement:
    """One worker process of a job a manager started."""
    manager: str
    rank: int
    world: int
    #: None where the manager does not say: the rendezvous numbers a machine's workers by rank
    local_rank: int | None
    local_size: int | None
    #: what tells machines apart: SLURM's node, torchrun's GROUP_RANK, else the host name
    machine: str
    #: the rendezvous (rank 0's address and port), or None and why not
    master: tuple[str, int] | None
    no_master: str = ""


@dataclass(frozen=True)
class NodePlacement:
    """One node of a PyTorchJob: this process starts the node's ``nproc`` workers."""
    manager: str
    node_rank: int
    nnodes: int
    #: None for "auto" / "gpu": as many as --gpus lists (or -n says)
    nproc: int | None
    master: tuple[str, int]


def detect(environ: Mapping[str, str], hostname: str | None = None
           ) -> Placement | NodePlacement | None:
    """This process's place, or None when no manager started it. A launcher that runs after
    another sets its variables on top (mpirun or torchrun inside a SLURM allocation), so the
    per-process launchers are read first and SLURM last."""
    env = {k: v for k, v in environ.items() if v.strip()}
    host = hostname or socket.gethostname()
    if "OMPI_COMM_WORLD_RANK" in env:
        return _mpi(env, host, "Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "PMI_RANK" in env:
        return _mpi(env, host, "MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                    "MPI_LOCALNRANKS")
    if "PET_NNODES" in env and "LOCAL_RANK" not in env:
        return _pytorchjob_node(env)
    if "RANK" in env:
        return _torchrun(env, host)
    if "SLURM_PROCID" in env:
        return _slurm(env, host)
    return None


def place_run(environ: Mapping[str, str], hosts: str | None, host_list: str | None,
              nproc: int | None, rank: int | None, pinned: tuple[int, ...] | None
              ) -> tuple[Placement | NodePlacement | None, int | None]:
    """How `poseidon train` runs: (the manager's place, when no table and no rank are given and
    one started this process; the local worker count, for -n, --gpus alone or a PyTorchJob pod).
    Neither: one process, as Caffe. Conflicting options raise ManagerError."""
    if host_list is not None and (hosts is not None or nproc is not None):
        raise ManagerError("-H lists the machines as a hosts file does: give -H, --hosts or -n, "
                           "not two")
    if pinned is not None and nproc not in (None, len(pinned)):
        raise ManagerError(f"--gpus starts one worker per GPU ({len(pinned)}): -n {nproc} "
                           "disagrees (leave it out)")
    managed = detect(environ) if (hosts, host_list, rank) == (None, None, None) else None
    if isinstance(managed, Placement) and (managed.world == 1 or nproc is not None):
        managed = None  # a job of one is trained as Caffe would; -n says where the workers are
    if pinned is not None and hosts is None and host_list is None \
            and not isinstance(managed, Placement):
        nproc = len(pinned)  # --gpus alone (or on a PyTorchJob pod): one worker per GPU
    return managed, nproc


def rank_from_env(environ: Mapping[str, str]) -> tuple[int, int | None, str] | None:
    """(rank, the job's size if the manager says, the manager) for a process started with a
    hosts file: its rank in that file is the manager's rank."""
    env = {k: v for k, v in environ.items() if v.strip()}
    for manager, rank, size in (("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                ("MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE"),
                                ("torchrun", "RANK", "WORLD_SIZE"),
                                ("SLURM", "SLURM_PROCID", "SLURM_NTASKS")):
        if rank in env:
            return (_int(env, rank), _int(env, size) if size in env else None, manager)
    return None


def _int(env: Mapping[str, str], var: str, minimum: int = 0) -> int:
    text = env[var].strip()
    try:
        value = int(text)
    except ValueError:
        raise ManagerError(f"{var}={text!r} is not a number") from None
    if value < minimum:
        raise ManagerError(f"{var}={value} must be at least {minimum}")
    return value


def _opt_int(env: Mapping[str, str], var: str, minimum: int = 0) -> int | None:
    return _int(env, var, minimum) if var in env else None


def _required(env: Mapping[str, str], var: str, manager: str) -> str:
    if var not in env:
        raise ManagerError(f"{manager}: {var} is not set (it says how many workers the job has)")
    return var


def _ranks(env: Mapping[str, str], manager: str, rank_var: str, size_var: str,
           local_var: str, local_size_var: str | None
           ) -> tuple[int, int, int | None, int | None]:
    world = _int(env, _required(env, size_var, manager), minimum=1)
    rank = _int(env, rank_var)
    if rank >= world:
        raise ManagerError(f"{rank_var}={rank} is out of range: {size_var}={world} "
                           f"(ranks 0..{world - 1})")
    local_size = _opt_int(env, local_size_var, minimum=1) if local_size_var else None
    if local_size is not None and local_size > world:
        raise ManagerError(f"{local_size_var}={local_size} is more than {size_var}={world}")
    local = _opt_int(env, local_var)
    if local is not None and local_size is not None and local >= local_size:
        raise ManagerError(f"{local_var}={local} is out of range: {local_size_var}="
                           f"{local_size} (local ranks 0..{local_size - 1})")
    return rank, world, local, local_size


def _master(env: Mapping[str, str], port_var: str = "MASTER_PORT"
            ) -> tuple[str, int] | None:
    if "MASTER_ADDR" not in env:
        return None
    return env["MASTER_ADDR"].strip(), _port(env, port_var) if port_var in env \
        else DEFAULT_MASTER_PORT


def _port(env: Mapping[str, str], var: str) -> int:
    port = _int(env, var, minimum=1)
    if port > 65535:
        raise ManagerError(f"{var}={port} is not a port (1..65535)")
    return port


def derived_port(job: str) -> int:
    """A rendezvous port from a job's id: every rank derives the same, and two jobs sharing a
    node rarely derive one port (when they do, the second says the port is taken)."""
    lo, hi = DERIVED_PORTS
    return lo + zlib.crc32(job.encode()) % (hi - lo)


def _mpi(env: Mapping[str, str], host: str, manager: str, rank_var: str, size_var: str,
         local_var: str, local_size_var: str) -> Placement:
    rank, world, local, local_size = _ranks(env, manager, rank_var, size_var, local_var,
                                            local_size_var)
    master = _master(env)
    why = ""
    if master is None:
        if local_size == world:  # every rank on this machine: meet here
            job = next((env[v] for v in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_PORT")
                        if v in env), None)
            if job is None and "PMI_FD" in env:
                # MPICH's Hydra names no job, but one machine's ranks share its proxy process:
                # two jobs at once on one machine then meet at two ports
                job = f"hydra proxy {os.getppid()}"

            master = ("127.0.0.1", derived_port(job) if job else DEFAULT_MASTER_PORT)
        else:
            why = (f"{manager} does not say where rank 0 runs: export MASTER_ADDR (rank 0's "
                   "host) and MASTER_PORT to every rank, e.g. mpirun -x MASTER_ADDR=node01 "
                   "-x MASTER_PORT=29500 ... (MPICH, Intel MPI: -genv)")
    return Placement(manager, rank, world, local, local_size, host, master, why)


def _torchrun(env: Mapping[str, str], host: str) -> Placement:
    rank, world, local, local_size = _ranks(env, "torchrun", "RANK", "WORLD_SIZE",
                                            "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    # torchrun's agent store may hold MASTER_PORT itself (it says so in this variable)
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    master = _master(env)
    if master is not None and agent_store:
        master = (master[0], master[1] + 1 if master[1] < 65535 else master[1] - 1)
    machine = f"node {env['GROUP_RANK']}" if "GROUP_RANK" in env else host
    return Placement("torchrun", rank, world, local, local_size, machine, master,
                     "" if master else "torchrun convention: MASTER_ADDR is not set (rank 0's "
                     "host; torchrun and the Kubernetes operators set it, with MASTER_PORT)")


def _pytorchjob_node(env: Mapping[str, str]) -> NodePlacement:
    nnodes_text = env["PET_NNODES"].strip()
    if ":" in nnodes_text:
        raise ManagerError(f"PET_NNODES={nnodes_text!r}: an elastic range; Poseidon trains on "
                           "a fixed set of nodes (leave out the PyTorchJob's elasticPolicy)")
    nnodes = _int(env, "PET_NNODES", minimum=1)
    node_rank = _int(env, _required(env, "PET_NODE_RANK", "PyTorchJob"))
    if node_rank >= nnodes:
        raise ManagerError(f"PET_NODE_RANK={node_rank} is out of range: PET_NNODES={nnodes} "
                           f"(nodes 0..{nnodes - 1})")
    nproc_text = env.get("PET_NPROC_PER_NODE", "auto").strip()
    nproc = None if nproc_text in ("auto", "gpu") else _int(env, "PET_NPROC_PER_NODE", 1)
    master = _master(env)
    if master is None:
        raise ManagerError("PyTorchJob: MASTER_ADDR is not set (the operator sets it to the "
                           "master pod's service)")
    return NodePlacement("PyTorchJob", node_rank, nnodes, nproc, master)


def _slurm(env: Mapping[str, str], host: str) -> Placement:
    if "SLURM_NTASKS" not in env and "SLURM_NPROCS" in env:  # older SLURM's name
        env = {**env, "SLURM_NTASKS": env["SLURM_NPROCS"]}
    rank, world, local, _ = _ranks(env, "SLURM", "SLURM_PROCID", "SLURM_NTASKS",
                                   "SLURM_LOCALID", None)
    list_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
                     if v in env), None)
    nodes = expand_nodelist(env[list_var], list_var) if list_var else []
    node = _opt_int(env, "SLURM_NODEID")
    local_size = None
    if node is not None and nodes:
        if node >= len(nodes):
            raise ManagerError(f"SLURM_NODEID={node} is out of range: {list_var} names "
                               f"{len(nodes)} nodes")
        per_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
                        if v in env), None)
        if per_var is not None:
            counts = tasks_per_node(env[per_var], per_var)
            if len(counts) != len(nodes) or sum(counts) != world:
                raise ManagerError(f"{per_var}={env[per_var]!r} does not fit {list_var} "
                                   f"({len(nodes)} nodes) and SLURM_NTASKS={world}")
            local_size = counts[node]
            if local is not None and local >= local_size:
                raise ManagerError(f"SLURM_LOCALID={local} is out of range: {per_var} runs "
                                   f"{local_size} tasks on node {nodes[node]}")
    machine = nodes[node] if node is not None and nodes else env.get("SLURMD_NODENAME", host)
    master = _master(env)
    why = ""
    if master is None:
        if nodes:  # rank 0 runs on the step's first node
            job = env.get("SLURM_JOB_ID")
            port = (derived_port(f"{job}.{env.get('SLURM_STEP_ID', '')}") if job
                    else DEFAULT_MASTER_PORT)
            master = (nodes[0], port)
        else:
            why = ("SLURM: no node list (SLURM_STEP_NODELIST, SLURM_NODELIST) says where rank 0 "
                   "runs: export MASTER_ADDR (and MASTER_PORT) to every task")
    return Placement("SLURM", rank, world, local, local_size, machine, master, why)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str, var: str = "SLURM_NODELIST") -> list[str]:
    """SLURM's compressed host list as `scontrol show hostnames` expands it:
    ``node[01-03,07],gpu5`` -> node01 node02 node03 node07 gpu5 (zero padding kept; several
    bracket groups in one name expand in order, ``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2)."""
    names: list[str] = []
    for item in _split_top(text.strip(), var, text):
        names += _expand_one(item, var, text)
    if not names:
        raise ManagerError(f"{var}={text!r} names no node")
    return names


def _split_top(text: str, var: str, whole: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
            if depth > 1:
                raise ManagerError(f"{var}={whole!r}: nested '['")
        elif c == "]":
            depth -= 1
            if depth < 0:
                raise ManagerError(f"{var}={whole!r}: ']' without '['")
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ManagerError(f"{var}={whole!r}: '[' without ']'")
    items.append(text[start:])
    if any(not item for item in items):
        raise ManagerError(f"{var}={whole!r}: an empty name")
    return items


def _expand_one(item: str, var: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise ManagerError(f"{var}={whole!r}: {part!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ManagerError(f"{var}={whole!r}: range {part!r} runs backwards")
        if int(hi) - int(lo) >= 65536:
            raise ManagerError(f"{var}={whole!r}: range {part!r} is too long")
        width = len(lo) if lo.startswith("0") else 0  # node[01-10]: two digits throughout
        values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    tails = _expand_one(rest, var, whole)
    return [f"{prefix}{v}{t}" for v in values for t in tails]


_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def tasks_per_node(text: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """SLURM's ``2(x3),1`` -> [2, 2, 2, 1]: the tasks on each node of the node list."""
    counts: list[int] = []
    for part in text.strip().split(","):
        m = _TASKS.match(part.strip())
        if m is None:
            raise ManagerError(f"{var}={text!r}: {part!r} is not N or N(xM)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts
