"""`poseidon train --elastic`: its options, and what the command starts.

With a listing (--hosts, -H, -n, --host-discovery) or none, this process is the driver
(driver.py) and starts the listed local workers itself; with ``--rendezvous HOST:PORT`` it is
a worker that joins the driver there (member.py): started by hand, by srun, or in a pod.
"""
from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any, Callable

import click

from engine.comm.errors import CommError

from ...job_config import JobConfig
from .policy import ElasticSettings

#: iterations between commits unless --commit-every says otherwise (README: measured cost)
DEFAULT_COMMIT_EVERY = 10
DEFAULT_BACKOFF_S = 10.0
DEFAULT_MAX_FAILURES = 3
DEFAULT_DISCOVERY_S = 3.0


@dataclass(frozen=True)
class ElasticOptions:
    """--elastic's options: the driver's settings (None for a worker that joins by hand,
    --rendezvous), its port and where it finds its workers."""
    settings: ElasticSettings | None
    rendezvous: str | None
    rendezvous_port: int
    discovery: str | None
    discovery_interval: float


_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--elastic",), dict(is_flag=True, help="Elastic training: workers may come and go while "
     "the job runs; the launcher is the driver (see the README).")),
    (("--min-workers",), dict(type=click.IntRange(min=1), default=None, help="--elastic: the "
     "job stops (writing its last commit) when fewer can train.")),
    (("--max-workers",), dict(type=click.IntRange(min=1), default=None,
                              help="--elastic: at most this many train at once.")),
    (("--commit-every",), dict(type=click.IntRange(min=1), default=DEFAULT_COMMIT_EVERY,
                               show_default=True, help="--elastic: commit the state in memory "
                               "every K iterations (a lost worker costs at most K).")),
    (("--elastic-lr",), dict(type=click.Choice(["none", "linear"]), default="none",
                             show_default=True, help="--elastic: scale base_lr with the global "
                             "batch against the first generation's (linear), or not.")),
    (("--global-batch",), dict(type=click.IntRange(min=1), default=None, help="--elastic: keep "
     "this global batch by iter_size = G / (workers x batch); refuse memberships where that is "
     "not whole.")),
    (("--backoff",), dict(type=click.FloatRange(min=0), default=DEFAULT_BACKOFF_S,
                          show_default=True, help="--elastic: seconds a failed worker waits "
                          "before it may join again (doubling while it keeps failing).")),
    (("--max-failures",), dict(type=click.IntRange(min=0), default=DEFAULT_MAX_FAILURES,
                               show_default=True, help="--elastic: failures in a row, each "
                               "before the job could commit with it, that exclude a worker; "
                               "and the times a job whose workers fail as they meet starts "
                               "again (0: no limit).")),
    (("--rendezvous",), dict(default=None, metavar="HOST:PORT", help="--elastic: join the "
     "driver at HOST:PORT as a worker (started by hand, srun, a pod).")),
    (("--rendezvous-port",), dict(type=click.IntRange(0, 65535), default=0, help="--elastic: "
     "the driver's port (0: a free one, printed).")),
    (("--host-discovery",), dict(default=None, metavar="CMD", help="--elastic: a command that "
     "prints the hosts the job may use now (hosts-file lines), run every few seconds.")),
    (("--discovery-interval",), dict(type=click.FloatRange(min=0.1), default=DEFAULT_DISCOVERY_S,
                                     show_default=True, help="--elastic: seconds between runs "
                                     "of --host-discovery.")),
]
#: the keywords click passes them as
_NAMES = {decls[0].lstrip("-").replace("-", "_") for decls, _ in _OPTIONS}


def elastic_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add --elastic and its options to `poseidon train`."""
    for decls, kwargs in reversed(_OPTIONS):
        command = click.option(*decls, **kwargs)(command)
    return command


def take_options(options: dict[str, Any]) -> ElasticOptions | None:
    """Remove the elastic options from ``options``; None without --elastic (then none of
    them may be given)."""
    given = {k: options.pop(k) for k in _NAMES}
    if not given["elastic"]:
        used = [k for k in ("min_workers", "max_workers", "global_batch", "rendezvous",
                            "host_discovery") if given[k] is not None]
        if used:
            raise CommError(f"--{used[0].replace('_', '-')} is an option of --elastic")
        return None
    mx, mn = given["max_workers"], given["min_workers"]
    settings = None
    if given["rendezvous"] is None:
        if mn is None:
            raise CommError("--elastic needs --min-workers N (the job stops when fewer can "
                            "train)")
        if mx is not None and mx < mn:
            raise CommError(f"--max-workers {mx} is below --min-workers {mn}")
        settings = ElasticSettings(mn, mx, given["commit_every"], given["elastic_lr"],
                                   given["global_batch"], given["backoff"],
                                   given["max_failures"])
    return ElasticOptions(settings, given["rendezvous"], given["rendezvous_port"],
                          given["host_discovery"], given["discovery_interval"])


def start(config: JobConfig, opts: ElasticOptions, hosts: str | None, host_list: str | None,
          nproc: int | None, launch: str) -> None:
    """Run the elastic job's driver, or join one (--rendezvous)."""
    if config.timeline is not None:
        raise CommError("--timeline merges one job's processes; an elastic job's change with "
                        "every generation: give it without --elastic")
    listed = [x for x in (hosts, host_list, nproc, opts.discovery) if x is not None]
    if len(listed) > 1:
        raise CommError("--elastic takes one listing: --hosts, -H, -n or --host-discovery")
    if opts.rendezvous is not None:
        if listed:
            raise CommError("--rendezvous joins a driver as one worker: give no listing "
                            "(--hosts, -H, -n, --host-discovery)")
        join(config, opts.rendezvous)
        return
    drive(config, opts, hosts, host_list, nproc, launch)


def drive(config: JobConfig, opts: ElasticOptions, hosts: str | None, host_list: str | None,
          nproc: int | None, launch: str) -> None:
    from engine import glog
    from engine.comm.auth import job_key, new_key
    from engine.comm.hosts import is_local, local_addresses

    from ..tables import resolve
    from .driver import Driver
    from .sources import Discovery, Fixed, HostsFile, slots_of

    s = opts.settings
    assert s is not None
    pinned = config.gpus if config.pin_gpus else None
    ports = contextlib.ExitStack()  # what -n / -H probed: held while the driver runs
    entries = resolve(hosts, host_list, nproc, pinned, ports) if (hosts or host_list or nproc) \
        else []
    here = local_addresses()
    by_hand = not entries or (launch != "ssh" and not all(is_local(e, here) for e in entries))
    key = job_key(config.key_file)
    if key is None:
        if by_hand and opts.discovery is None:
            raise CommError("workers that join an elastic job by hand need its key: make one "
                            "with `poseidon keygen job.key` and give --key-file job.key to the "
                            "driver and to every worker")
        key = new_key()
    if hosts is not None:
        source: Any = HostsFile(hosts)
    elif opts.discovery is not None:
        source = Discovery(opts.discovery, opts.discovery_interval)
    else:
        source = Fixed(slots_of(entries), host_list and f"-H {host_list}" or
                       (f"-n {nproc}" if nproc else "workers that join by hand"))
    # a worker listed on this machine binds its port and the next: never the driver's
    listed = frozenset(p for slot in slots_of(entries) for p in (slot.port, slot.port + 1))
    driver = Driver(config, s, source, key, batch_facts(config.solver), opts.rendezvous_port,
                    launch, avoid=listed)
    at = f"{socket.gethostname()}:{driver.port}"
    joins = (f"a worker joins with `poseidon train --solver {config.solver} --elastic "
             f"--rendezvous {at} --key-file {config.key_file}`" if config.key_file else
             "the launcher made this job's key for the workers it starts; to let others join "
             "by hand, start the job with --key-file (`poseidon keygen job.key`)")
    glog.info(f"Elastic driver at {at} ({joins}): {s.min_workers} to "
              f"{s.max_workers or 'any number of'} workers, a commit every {s.commit_every} "
              "iterations; each worker keeps its batch, so P workers train with P times the "
              "batch" + (f" (--global-batch {s.global_batch}: iter_size adapts)"
                         if s.global_batch else ""))
    with ports:
        driver.run()


def batch_facts(solver: str) -> Any:
    """The per-worker batch of ``solver``'s net and its iter_size, for the batch rule."""
    from engine.caffe_io import read_solver_prototxt
    from engine.perf.netinfo import net_info

    from .driver import BatchFacts

    try:
        batch = net_info(solver).batch
    except Exception as e:  # noqa: BLE001 - any net the engine builds has one; name why not
        raise CommError(f"--elastic: cannot tell the batch of {solver}'s net: {e}") from None
    return BatchFacts(batch, read_solver_prototxt(solver).iter_size)


def join(config: JobConfig, rendezvous: str) -> None:
    """Be one worker of the driver at ``rendezvous``: on a free port pair of this machine,
    at its address on the route to the driver."""
    import os

    from ..hostfile import reserve_ports
    from ..managers import Placement, detect
    from ..rendezvous import own_address
    from .member import run_member

    host, sep, port_text = rendezvous.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise CommError(f"--rendezvous {rendezvous!r}: expected HOST:PORT")
    port = int(port_text)
    me = own_address(host, port)
    base, held = reserve_ports(1, "0.0.0.0", avoid=frozenset({port}))
    for s in held:
        s.close()
    placement = None
    try:
        placement = detect(os.environ)
    except CommError:
        placement = None
    machine = placement.machine if isinstance(placement, Placement) else socket.gethostname()
    local = placement.local_rank if isinstance(placement, Placement) else None
    gpus = config.gpus
    gpu = gpus[(local or 0) % len(gpus)] if gpus else None
    run_member(config, f"{host}:{port}", me, base, machine, gpu)
