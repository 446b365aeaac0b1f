"""`poseidon train` on several workers: start the local ones and supervise them, or be one.

* With a host table (--hosts, -H, -n, --gpus; tables.py) and no rank, this process starts one
  worker process per local entry (and, with ``--launch ssh``, per remote one), hands each the
  table on its standard input, and supervises them: when any fails, every other one is stopped
  and the error names it; signals are passed on (``launch_all``).
* With a table and a rank (--rank, or a manager's rank variable), this process is that worker.
* With a cluster manager's variables and no table (``srun``, ``mpirun``, torchrun's convention;
  managers.py), this process is the worker the manager says and learns the table at the
  rendezvous (worker.py's ``run_managed``); a PyTorchJob pod starts its node's workers, which
  do that (``launch_node``).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Any, NamedTuple, Sequence

from engine.comm.auth import KEY_ENV, job_key, key_hex, new_key
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, is_local, local_addresses, table_json

from ..console import plural
from ..job_config import JobConfig, require_key
from .managers import NodePlacement, Placement, rank_from_env
from .relay import ErrorRelay
from .tables import gpus_of

#: torchrun's variables, which a PyTorchJob node sets for each worker it starts
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


def worker_command(rank: int | None, gpu: int | None) -> list[str]:
    """The command line of worker ``rank``: its rank and GPU only. The job's configuration
    and the table come on its standard input (``worker_input``), where `ps` does not show
    them; without a rank, the table comes from the rendezvous."""
    cmd = [sys.executable, "-m", "poseidon_cli.launch.worker"]
    if rank is not None:
        cmd += ["--rank", str(rank)]
    if gpu is not None:
        cmd += ["--gpu", str(gpu)]
    return cmd


def worker_input(config: JobConfig, entries: list[HostEntry] | None) -> bytes:
    """A worker's standard input: the job's configuration as one line of JSON, then the host
    table (one line of JSON) when it has a rank in it."""
    lines = [config.to_json()] + ([table_json(entries)] if entries is not None else [])
    return "".join(line + "\n" for line in lines).encode()


def ssh_command(entry: HostEntry, cmd: Sequence[str]) -> list[str]:
    """Run ``cmd`` on ``entry``'s machine in the same directory (shared file system assumed).
    The job key comes on the first line of its standard input, never on a command line; the
    rest of that input is the worker's."""
    remote = (f"cd {shlex.quote(os.getcwd())} && IFS= read -r {KEY_ENV} && export {KEY_ENV} "
              f"&& exec {shlex.join(cmd)}")
    return ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", entry.host, remote]


def start(config: JobConfig, managed: Placement | NodePlacement | None, hosts: str | None,
          host_list: str | None, nproc: int | None, rank: int | None, launch: str) -> None:
    """What `poseidon train` does with several workers: under a manager without a table, be
    its worker (or start a PyTorchJob node's); else resolve the table (tables.py) and run."""
    if isinstance(managed, NodePlacement):
        launch_node(config, managed, nproc)
    elif managed is not None:
        from .worker import run_managed
        run_managed(config, managed)
    else:
        from .tables import resolve
        pinned = config.gpus if config.pin_gpus else None
        with contextlib.ExitStack() as ports:  # probed ports held until the job ends
            entries = resolve(hosts, host_list, nproc, pinned, ports)
            # `srun poseidon train --hosts H`: the manager's rank is the rank in the file (-H
            # and -n probe their ports: only a launcher that starts every worker can hand them
            # out)
            if rank is None and hosts is not None and (found := rank_from_env(os.environ)):
                rank, world, manager = found
                if world is not None and world != len(entries):
                    raise CommError(f"{manager} started {world} workers, but {hosts} lists "
                                    f"{len(entries)}")
            run(config, entries, rank, launch)


def run(config: JobConfig, entries: list[HostEntry], rank: int | None = None,
        launch: str = "local") -> None:
    """Start and supervise the table's workers, or be worker ``rank``; raises CommError with a
    one-line message."""
    if launch not in ("local", "ssh"):
        raise CommError(f"--launch must be 'local' or 'ssh', got {launch!r}")
    if rank is None:
        launch_all(config, entries, launch)
        return
    if not 0 <= rank < len(entries):
        raise CommError(f"--rank {rank} out of range: {config.hosts} lists {len(entries)} "
                        "workers")
    from .worker import run_worker
    run_worker(config, entries, rank, gpus_of(entries, config)[rank])


class Child(NamedTuple):
    """A process a launcher starts: its name in errors, command, environment, standard input."""
    name: str
    cmd: list[str]
    env: dict[str, str]
    stdin: bytes


def launch_all(config: JobConfig, entries: list[HostEntry], launch: str) -> None:
    """Start every local worker (and, with ssh, the remote ones), each with the table on its
    standard input, and supervise them (``start_and_supervise``)."""
    local = local_addresses()
    remote = [e for e in entries if not is_local(e, local)]
    if remote and launch != "ssh":
        print(f"poseidon: {plural(len(remote), 'worker')} not on this machine: start each "
              f"within {config.startup_timeout:g} s (--startup-timeout) with the same files "
              "and key file there (or use --launch ssh):", file=sys.stderr)
        for e in remote:
            print(f"poseidon:   on {e.host}: {by_hand_command(e.rank)}", file=sys.stderr)
    key = job_key(config.key_file)
    if key is None:
        if remote and launch != "ssh":
            raise CommError(f"{len(remote)} workers are not on this machine and will be started "
                            "by hand: they need this job's key. Make one with `poseidon keygen "
                            "job.key`, copy it to every host and give --key-file job.key to "
                            "every rank")
        key = new_key()  # a fresh key per launch: an earlier run's messages cannot be replayed
    plain_env = {k: v for k, v in os.environ.items() if k != KEY_ENV}  # ssh: the key goes on stdin
    env = {**plain_env, KEY_ENV: key_hex(key)}
    stdin = worker_input(config, entries)
    gpu_of = gpus_of(entries, config)
    children = []
    for e in entries:
        cmd = worker_command(e.rank, gpu_of[e.rank])
        if is_local(e, local):
            children.append(Child(f"worker {e.rank} ({e})", cmd, env, stdin))
        elif launch == "ssh":
            children.append(Child(f"worker {e.rank} ({e})", ssh_command(e, cmd), plain_env,
                                  (key_hex(key) + "\n").encode() + stdin))
    if not children:
        raise CommError(f"{config.hosts}: no worker is on this machine; run `poseidon train ... "
                        "--rank N` on each host, or use --launch ssh")
    check_ports([e for e in entries if is_local(e, local)])
    start_and_supervise(children, config)


def by_hand_command(rank: int) -> str:
    """This very `poseidon train` command line, as worker ``rank`` runs it on its machine."""
    args = list(sys.argv[1:])
    for flag in ("--rank",):  # a rank given here is this process's
        while flag in args:
            i = args.index(flag)
            del args[i:i + 2]
    return " ".join(shlex.quote(a) for a in ["poseidon", *args, "--rank", str(rank)])


def check_ports(entries: list[HostEntry]) -> None:
    """Every port these local workers and their shards will bind is free now: a port another
    process holds is named before any worker spends seconds building its net. (A port taken
    after this check is still named, by the worker that cannot bind it.)"""
    from engine.comm.hosts import port_owner
    from engine.comm.transport import SHARD, WORKER, peer_name

    for e in entries:
        for role, port in ((WORKER, e.port), (SHARD, e.shard_port)):
            s = socket.socket()
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                s.bind(("", port))
            except OSError as err:
                owner = port_owner(port)
                held = f" (held by {owner})" if owner else ""
                raise CommError(f"{peer_name((role, e.rank), entries)}: cannot bind port "
                                f"{port}{held}: {err.strerror}") from None
            finally:
                s.close()


def launch_node(config: JobConfig, node: NodePlacement, nproc: int | None) -> None:
    """A PyTorchJob pod, as torchrun would: start this node's workers (``nproc``: from -n or
    --gpus, else the operator's count) with torchrun's variables (each then meets the others at
    the rendezvous) and supervise them."""
    if nproc is not None and node.nproc not in (None, nproc):
        raise CommError(f"PET_NPROC_PER_NODE={node.nproc}, but -n / --gpus ask for {nproc} "
                        "workers on this node")
    nproc = nproc or node.nproc or 1
    key = require_key(config)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("PET_") and k not in TORCHRUN_VARS}
    master_addr, master_port = node.master
    children = []
    for i in range(nproc):
        rank = node.node_rank * nproc + i
        env = {**base, KEY_ENV: key_hex(key), "RANK": str(rank),
               "WORLD_SIZE": str(node.nnodes * nproc), "LOCAL_RANK": str(i),
               "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node.node_rank),
               "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}
        children.append(Child(f"worker {rank} (node {node.node_rank} local rank {i})",
                              worker_command(None, None), env, worker_input(config, None)))
    start_and_supervise(children, config)


def start_and_supervise(children: list[Child], config: JobConfig) -> None:
    """Start the children and supervise them. SIGINT, SIGTERM and SIGHUP are passed on to
    each, which acts on them as the solver's signal effects say, at the iteration all workers
    agree on (engine/comm/syncer.py); a second SIGINT or SIGTERM stops every process at once."""
    procs: dict[str, subprocess.Popen] = {}
    relay = ErrorRelay()
    effects = config.signal_effects
    forwarded: set[int] = set()

    def forward(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if effects.get(name if name != "SIGTERM" else "SIGINT", "") == "none":
            return
        if signum != signal.SIGHUP and signum in forwarded:
            raise KeyboardInterrupt  # asked twice: stop now
        forwarded.add(signum)
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)  # the worker alone: it stops its own shard
                except ProcessLookupError:
                    pass

    # set explicitly: a launcher started in the background by a script inherits SIGINT ignored
    handled = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s]
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        for child in children:
            # own session: Ctrl-C reaches the launcher only, which then stops everything
            proc = subprocess.Popen(child.cmd, start_new_session=True, stderr=subprocess.PIPE,
                                    env=child.env, stdin=subprocess.PIPE)
            procs[child.name] = proc
            relay.watch(proc)
            assert proc.stdin is not None
            try:
                proc.stdin.write(child.stdin)
                proc.stdin.close()
            except BrokenPipeError:  # it died at once: supervise names it
                pass
        supervise(procs, relay, config.snapshot)
    except KeyboardInterrupt:
        stop_all(procs)
        raise CommError(f"interrupted twice: stopped all {len(procs)} worker processes at once, "
                        "without a snapshot") from None
    finally:
        stop_all(procs)
        for s, h in previous.items():
            signal.signal(s, h)


def supervise(procs: dict[str, subprocess.Popen], relay: ErrorRelay | None = None,
              resumed_from: str | None = None, poll_s: float = 0.1) -> None:
    """Wait for every process; the first that fails stops the others. The error is the first
    one a process reported (the real cause), else the failing process names itself."""
    running = dict(procs)
    while running:
        for name, p in list(running.items()):
            rc = p.poll()
            if rc is None:
                continue
            del running[name]
            if rc != 0:
                # what was reported up to now is the cause; what the others say once stopped
                # is a consequence
                reported = relay.first_error(p) if relay is not None else None
                if reported is None:
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    last = (relay.last_snapshot if relay is not None else None) or resumed_from
                    reported = (f"{name} {how}; stopped the other "
                                f"{plural(len(running), 'worker')}; "
                                f"last good snapshot: {last or 'none'}")
                stop_all(running)
                raise CommError(reported)
        time.sleep(poll_s)


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGKILL each process group (a worker and its shard). Not SIGTERM: a worker takes that
    as a request to snapshot and stop, which a run that lost a peer cannot do. Snapshots are
    written atomically, so nothing is left half-written."""
    for p in procs.values():
        _signal_group(p, signal.SIGKILL)
        if p.poll() is None:
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its group; its shard child is in it
    except (ProcessLookupError, PermissionError):
        pass
