"""`poseidon train --hosts`: start, wire up and supervise the processes of a distributed run.

Started without a rank (none given, none in SLURM_PROCID / OMPI_COMM_WORLD_RANK / RANK), the
launcher starts one worker process per local hosts entry (and, with ``--launch ssh``, one per
remote entry over ssh) and supervises them: when any of them fails, every other one is stopped
and the error names it; Ctrl-C stops them all. Each worker process (``--rank N``, by hand or
from the launcher) starts its node's PS shard server as a child process, builds the Solver
with ``RunContext(rank, P)``, meets every peer at the start-up barrier, prints the plan (rank
0), trains with the DWBP syncer attached, and finally says BYE.

Shard processes run ``python -m engine.comm.launcher shard --hosts H --index I``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from .errors import CommError
from .hosts import HostEntry, is_local, local_addresses, parse_hosts
from .planner import plan_layers, plan_table
from .relay import ErrorRelay
from .ps import DEFAULT_CHUNK_BYTES, ShardServer, make_layout
from .stats import CommStats

RANK_ENV = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "RANK")
#: after a fatal error, a process still busy computing is stopped this many seconds later
EXIT_GRACE_S = 2.0


def rank_from_env(environ: dict[str, str] | None = None) -> int | None:
    env = os.environ if environ is None else environ
    for var in RANK_ENV:
        if env.get(var, "").strip():
            try:
                return int(env[var])
            except ValueError:
                raise CommError(f"{var}={env[var]!r} is not a rank number") from None
    return None


def worker_command(rank: int, solver: str, hosts: str, comm: str, timeout: float,
                   chunk_bytes: int, weights: str | Sequence[str] | None, snapshot: str | None,
                   gpu: Any, stats: str | None,
                   signal_effects: dict[str, str] | None = None, replay: str | None = None,
                   time_scale: float = 1.0, timeline: str | None = None) -> list[str]:
    """The command line of worker ``rank`` (the same `poseidon train`, with ``--rank``)."""
    cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", solver, "--hosts", hosts,
           "--rank", str(rank), "--comm", comm, "--timeout", f"{timeout:g}"]
    effects = signal_effects or {}
    for flag, sig in (("--sigint-effect", "SIGINT"), ("--sighup-effect", "SIGHUP")):
        if sig in effects:
            cmd += [flag, effects[sig]]
    if chunk_bytes != DEFAULT_CHUNK_BYTES:
        cmd += ["--chunk-bytes", str(chunk_bytes)]
    for flag, value in (("--weights", weights), ("--snapshot", snapshot), ("--gpu", gpu)):
        if value is not None and value != "" and value != []:  # GPU 0 is a value
            cmd += [flag, value if isinstance(value, str) else ",".join(map(str, value))
                    if isinstance(value, (list, tuple)) else str(value)]
    if stats is not None and rank == 0:
        cmd += ["--stats", stats]
    if replay is not None:
        cmd += ["--replay", replay, "--time-scale", f"{time_scale:g}"]
    if timeline is not None:
        cmd += ["--timeline", timeline]
    return cmd


def ssh_command(entry: HostEntry, cmd: Sequence[str]) -> list[str]:
    """Run ``cmd`` on ``entry``'s machine in the same directory (shared file system assumed)."""
    remote = f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(cmd)}"
    return ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", entry.host, remote]


def shard_command(index: int, hosts: str, timeout: float, timeline: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "engine.comm.launcher", "shard", "--hosts", hosts,
           "--index", str(index), "--timeout", f"{timeout:g}"]
    return cmd + (["--timeline", timeline] if timeline else [])


# ------------------------------------------------------------------------------- entry point
def run_from_cli(solver: str, hosts: str, rank: int | None = None, comm: str = "hybrid",
                 launch: str = "local", stats: str | None = None, timeout: float = 30.0,
                 weights: str | None = None, snapshot: str | None = None,
                 gpu: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 signal_effects: dict[str, str] | None = None, replay: str | None = None,
                 time_scale: float = 1.0, timeline: str | None = None, **_: Any) -> None:
    """What `poseidon train --hosts H` does; raises CommError with a one-line message."""
    if launch not in ("local", "ssh"):
        raise CommError(f"--launch must be 'local' or 'ssh', got {launch!r}")
    if timeout <= 0:
        raise CommError(f"--timeout must be positive, got {timeout:g}")
    entries = parse_hosts(hosts)
    rank = rank if rank is not None else rank_from_env()
    if rank is None:
        launch_all(entries, solver, hosts, comm, launch, stats, timeout, weights, snapshot, gpu,
                   chunk_bytes, signal_effects, replay, time_scale, timeline)
        return
    if not 0 <= rank < len(entries):
        raise CommError(f"--rank {rank} out of range: {hosts} lists {len(entries)} hosts")
    run_worker(entries, rank, solver, hosts, comm, stats, timeout, weights, snapshot,
               assign_gpus(entries, gpu)[rank], chunk_bytes, signal_effects, replay, time_scale,
               timeline)


# ------------------------------------------------------------------------------ the launcher
def launch_all(entries: list[HostEntry], solver: str, hosts: str, comm: str, launch: str,
               stats: str | None, timeout: float, weights: str | None, snapshot: str | None,
               gpu: Any, chunk_bytes: int, signal_effects: dict[str, str] | None = None,
               replay: str | None = None, time_scale: float = 1.0,
               timeline: str | None = None) -> None:
    """Start every local worker (and, with ssh, the remote ones) and supervise them. SIGINT,
    SIGTERM and SIGHUP are passed on to each local worker, which acts on them as the solver's
    signal effects say, at the iteration all workers agree on (engine/comm/syncer.py); a
    second SIGINT or SIGTERM stops every process at once."""
    local = local_addresses()
    procs: dict[str, subprocess.Popen] = {}
    remote = [e for e in entries if not is_local(e, local)]
    if remote and launch != "ssh":
        print(f"poseidon: {len(remote)} hosts are not this machine; start them with "
              f"`poseidon train ... --rank N` there (or use --launch ssh): "
              + ", ".join(f"rank {e.rank} at {e}" for e in remote), file=sys.stderr)
    gpu_of = assign_gpus(entries, gpu)
    relay = ErrorRelay()
    effects = signal_effects or {}
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
        for e in entries:
            cmd = worker_command(e.rank, solver, hosts, comm, timeout, chunk_bytes, weights,
                                 snapshot, gpu_of[e.rank], stats, signal_effects, replay,
                                 time_scale, timeline)
            if not is_local(e, local):
                if launch != "ssh":
                    continue
                cmd = ssh_command(e, cmd)
            # own session: Ctrl-C reaches the launcher only, which then stops everything
            proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE)
            relay.watch(proc)
            procs[f"worker {e.rank} ({e})"] = proc
        if not procs:
            raise CommError(f"{hosts}: no entry is this machine; run `poseidon train ... --rank N` "
                            "on each host, or use --launch ssh")
        supervise(procs, relay, snapshot)
    except KeyboardInterrupt:
        stop_all(procs)
        raise CommError(f"interrupted twice: stopped all {len(procs)} worker processes at once, "
                        "without a snapshot") from None
    finally:
        stop_all(procs)
        for s, h in previous.items():
            signal.signal(s, h)


def assign_gpus(entries: list[HostEntry], gpus: Sequence[int] | int | None) -> dict[int, int | None]:
    """Each rank's GPU: the machine's workers take ``gpus`` round robin, in hosts-file order."""
    if gpus is None:
        return {e.rank: None for e in entries}
    ids = [gpus] if isinstance(gpus, int) else list(gpus)
    seen: dict[str, int] = {}
    out: dict[int, int | None] = {}
    for e in entries:
        i = seen.get(e.host, 0)
        seen[e.host] = i + 1
        out[e.rank] = ids[i % len(ids)]
    return out


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
                    reported = (f"{name} {how}; stopped the other {len(running)} workers; "
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


# -------------------------------------------------------------------------------- a worker
def run_worker(entries: list[HostEntry], rank: int, solver_path: str, hosts: str, comm: str,
               stats_path: str | None, timeout: float, weights: str | None,
               snapshot: str | None, gpu: Any, chunk_bytes: int,
               signal_effects: dict[str, str] | None = None, replay: str | None = None,
               time_scale: float = 1.0, timeline: str | None = None) -> None:
    """Train as worker ``rank``: solver, own shard, barrier, plan, DWBP, BYE."""
    from engine import backend, glog
    from engine.context import RunContext
    from engine.solver import Solver

    from .bind import describe_net, ps_params
    from .syncer import Syncer, open_worker

    world = len(entries)
    if gpu is not None:
        backend.use_gpu(int(gpu))
    context = RunContext(rank=rank, world_size=world)
    if replay is not None:
        from engine.perf.replay import make_solver
        solver = make_solver(solver_path, replay, time_scale, context=context, is_root=rank == 0)
    else:
        solver = Solver(solver_path, context=context, is_root=rank == 0)
    solver.signal_effects.update(signal_effects or {})
    for w in weights.split(",") if isinstance(weights, str) else weights or ():
        if w:
            solver.load_weights(w)
    slots, infos = describe_net(solver.net)
    try:
        plans = plan_layers(infos, world, comm=comm, allow_sfb=solver.param.iter_size == 1)
    except ValueError:
        solver.close()
        raise
    schemes = {p.info.layer: p.scheme for p in plans}
    layout = make_layout(ps_params(slots, schemes), world, chunk_bytes)
    if rank == 0:
        glog.info(plan_table(plans, world))
        total = solver.images_per_iter()  # the data layers stride over every rank's share
        glog.info(f"The losses and outputs below are rank 0's, over its {total // world} of the "
                  f"{total} images of each iteration")
    stats = CommStats()
    stats.extra["plan"] = [{"layer": p.info.name, "shapes": p.info.shapes, "scheme": p.scheme,
                            "bytes_per_node": p.bytes_per_node, "ps_bytes": p.ps_bytes,
                            "sfb_bytes": p.sfb_bytes, "ring_bytes": p.ring_bytes} for p in plans]
    stats.extra.update(rank=rank, world_size=world, comm=comm)
    if timeline is not None:
        from engine.perf import timeline as tl
        tl.start(timeline, f"worker {rank}", f"worker{rank}")
    shard = subprocess.Popen(shard_command(rank, hosts, timeout, timeline), stderr=subprocess.PIPE)
    shard_errors: list[str] = []
    ep = None

    def shard_failed(reason: str) -> None:  # e.g. its port is taken: stop now, not at timeout
        shard_errors.append(reason)
        if ep is not None:
            ep.fatal(reason)

    relay = ErrorRelay(on_error=shard_failed)
    relay.watch(shard)
    try:
        ep = open_worker(rank, entries, timeout=timeout, stats=stats,
                         exit_grace=EXIT_GRACE_S, snapshot_hint=lambda: str(solver.last_snapshot or "none"))
        if shard_errors:
            ep.fatal(shard_errors[0])
        display = solver.param.display

        def report(rnd: int) -> None:
            if rank == 0 and display and (rnd + 1) % display == 0:
                for line in stats.format_lines():
                    glog.info(line)

        solver.attach_sync(Syncer(ep, slots, schemes, layout, solver.update_layer,
                                  on_round_done=report))
        solver.solve(resume_file=snapshot)
        solver.close()  # the last updates, the replica check, BYE; then the shard ends
        shard.wait(timeout=timeout)
        if shard.returncode:
            raise CommError(f"shard {rank} ({entries[rank].host}:{entries[rank].shard_port}) "
                            f"exited with code {shard.returncode}")
    finally:
        solver.close()  # on failure: stop the comm and prefetch threads so the process can exit
        if stats_path is not None and rank == 0:
            stats.write_json(stats_path)
        if shard.poll() is None:
            shard.kill()  # it ignores the polite signals (see main); it holds nothing to save
            shard.wait()
        if timeline is not None:
            tl.current.save_part()
            if rank == 0:  # the worker and shard of each entry on this machine
                here = local_addresses()
                tl.merge(timeline, expected=2 * sum(is_local(e, here) for e in entries))


# --------------------------------------------------------------------------------- a shard
def run_shard(index: int, hosts: str, timeout: float, timeline: str | None = None) -> int:
    entries = parse_hosts(hosts)
    if timeline is not None:
        from engine.perf import timeline as tl
        tl.start(timeline, f"shard {index}", f"shard{index}")
    srv = ShardServer(index, entries, timeout=timeout, exit_grace=EXIT_GRACE_S)
    try:
        srv.start()
        srv.serve()
    except CommError as e:
        srv.ep.disarm()
        if not srv.ep.error_from_peer:  # its worker shares this stderr and reports relayed ones
            print(f"poseidon: error: {e}", file=sys.stderr)
        return 1
    finally:
        srv.close()
        if timeline is not None:
            tl.current.save_part()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.comm.launcher")
    sub = ap.add_subparsers(dest="what", required=True)
    sh = sub.add_parser("shard", help="run one node's parameter-server shard")
    sh.add_argument("--hosts", required=True)
    sh.add_argument("--index", type=int, required=True)
    sh.add_argument("--timeout", type=float, default=30.0)
    sh.add_argument("--timeline", default=None)
    args = ap.parse_args(argv)
    # A shard lives and ends with its worker: Ctrl-C on a terminal, SLURM's SIGTERM to every
    # process of a step, or a hang-up ask the worker to snapshot or stop, and it needs its
    # shard for that; the shard also ends when its peers say BYE or go silent.
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    try:
        return run_shard(args.index, args.hosts, args.timeout, args.timeline)
    except CommError as e:
        print(f"poseidon: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
