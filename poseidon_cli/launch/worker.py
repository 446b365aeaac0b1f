"""One worker process of a distributed run.

It starts its node's PS shard server as a child process, builds the Solver with
``RunContext(rank, P)``, meets every peer at the start-up barrier, prints the plan (rank 0),
trains with the DWBP syncer attached, and finally says BYE. The launcher starts it as
``python -m poseidon_cli.launch.worker --rank N [--gpu G]`` with the job's configuration and
the host table on its standard input, a line of JSON each (a PyTorchJob pod starts it without
``--rank`` and the table: it meets the others at the rendezvous); a worker started by hand
(`poseidon train ... --rank N`) or by a cluster manager (`srun poseidon train ...`) runs
``run_worker`` in the CLI's process. Its shard gets its settings, the table and the key on its
standard input (shard.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

# (the package poseidon_cli, imported first, sets one BLAS thread before NumPy loads: a worker
# started over ssh does not inherit the launcher's environment)
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, is_local, local_addresses, table_from_json
from engine.perf.cpu import CpuMeter

from ..console import plural, run_process, user_errors
from ..training import train_process
from ..job_config import JobConfig, require_key
from .managers import Placement, detect
from .relay import ErrorRelay
from .exits import EXIT_GRACE_S, ForcedExit
from .shard import ShardSettings, ShardStarter


def run_worker(config: JobConfig, entries: list[HostEntry], rank: int, gpu: int | None) -> None:
    """Train as worker ``rank`` of ``entries`` on ``gpu`` (None: the CPU)."""
    from engine import glog
    from engine.context import RunContext

    key = require_key(config)
    if config.log_dir is not None:
        Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        glog.add_file(str(Path(config.log_dir) / f"rank{rank}.log"))
    glog.set_enabled(rank == 0)  # the others show only their warnings and errors (as Caffe)
    here = local_addresses()
    # The shard process does its imports while this one builds the net: started only when the
    # endpoint opens, a shard on a busy machine could miss a short --timeout's start-up barrier
    shards = ShardStarter()
    shards.prepare()
    try:
        train_process(config, RunContext(rank=rank, world_size=len(entries)), gpu,
                      attach=lambda solver: communicator(config, entries, rank, gpu, key, solver,
                                                         shards=shards),
                      # rank 0 merges the timeline parts of the worker and shard of each entry
                      timeline_parts=2 * sum(is_local(e, here) for e in entries))
    finally:
        shards.close()  # one started ahead and never used (the net failed to build)


@contextlib.contextmanager
def communicator(config: JobConfig, entries: list[HostEntry], rank: int, gpu: int | None,
                 key: bytes, solver: Any, *, shards: ShardStarter,
                 exit_grace: float | None = EXIT_GRACE_S,
                 on_endpoint: Callable[[Any], None] | None = None,
                 wrap_sync: Callable[[Any, Any], Any] | None = None) -> Iterator[None]:
    """A worker's side of the job around its training: its PS shard (a child process), its
    endpoint, the start-up barrier and the plan, the syncer attached to ``solver``; on the way
    out, the last updates, the replica check and BYE, the shard's end and the counters.
    ``shards`` holds the shard process started ahead (at the worker's start, or an elastic
    member's once per generation), which gets its settings here.

    An elastic generation plugs in: ``exit_grace`` None (a failure must not end the process:
    it goes on to the next generation), ``on_endpoint(ep)`` once the endpoint is open (the
    driver can fail it from then on), ``wrap_sync(ep, syncer)`` after the start-up barrier:
    what to attach instead of the syncer (its boundaries), and its plan is never refused: a
    --plan that does not fit this generation's workers is replaced, saying why."""
    from engine import glog
    from engine.comm.bind import describe_net
    from engine.comm.link import LinkError, parse_link
    from engine.comm.plan_file import write_plan
    from engine.comm.planner import make_plan, overhead_of, plan_table
    from engine.comm.stats import CommStats
    from engine.comm.syncer import Syncer, open_worker
    from engine.comm.wire import frame_limit
    from engine.snapshots import describe_os_error
    from engine.solvers import SolverError

    world = len(entries)
    slots, infos = describe_net(solver.net)
    momentum = 0.0  # sparse's momentum correction: the codec keeps the solver's momentum
    if config.sparse and config.momentum_correction:
        try:
            momentum = solver.sync_momentum()
        except SolverError as e:
            raise CommError(f"--sparse: {e}; give --no-momentum-correction") from None
    try:
        link = parse_link(config.link) if config.link is not None else None
    except LinkError as e:
        raise CommError(f"--link: {e}") from None
    total = solver.images_per_iter()  # the data layers stride over every rank's share
    stats = CommStats()
    stats.extra.update(rank=rank, world_size=world, comm=config.comm, wire=config.wire,
                       sparse=config.sparse)

    allow_sfb = solver.param.iter_size == 1
    # rank 0 plans; a plan to follow is read and checked before anyone waits for it
    pinned = recorded_plan(config, infos, entries, allow_sfb, gpu is not None, momentum,
                           strict=wrap_sync is None) if rank == 0 else None
    allowed, required = config.engines
    if pinned is not None:  # its engines, and no other
        allowed = required = tuple(e.name for e in pinned[0].used_engines)

    def planner(probed: Any, local: Any, engines: Any, crowding: float,
                shm_probe: Any) -> Any:  # rank 0's
        plan, why = pinned or (None, "")  # (every worker follows rank 0's)
        if plan is None:
            options = plan_options(config, entries, allow_sfb, gpu is not None, momentum,
                                   solver.net, infos, probed, local, engines, crowding=crowding,
                                   shm_probe=shm_probe)
            if crowding > 1:
                overhead = overhead_of(options.link, options.local_link)
                glog.info(f"This machine runs {crowding:g} workers a core: the plan prices "
                          f"the CPU of each message ({overhead * 1e6:.0f} us at each end, "
                          "probed) as compute taken from them")
            plan = make_plan(infos, world, options)
            why = plan.why()
        for e in plan.used_engines:
            glog.info(f"The gradients of {sum(1 for _, s in plan.units if s == e.name)} units "
                      f"travel on {e.name} ({e.version}, {e.algorithm}), which authenticates "
                      "nothing: whoever can reach the workers' network can read and alter them "
                      "(the plan, signals and elastic control stay authenticated)")
        levels = (f" ({world // plan.slots} machines of {plan.slots}, reducing inside each "
                  "machine first)" if plan.slots > 1 else "")
        wire = f"; wire {plan.wire()}" if plan.codec != "fp32" else ""
        glog.info(f"Communication plan for {plural(world, 'worker')}{levels}: {plan.summary()} "
                  f"({why})"
                  f"{wire}")
        written = f"{solver.snapshot_prefix()}_plan.prototxt"
        try:
            write_plan(written, plan.to_pb())
            glog.info(f"Plan written to {written}: `--plan {written}` makes another run follow it")
        except OSError as e:
            glog.warning(f"cannot write the plan to {written}: {describe_os_error(e)}")
        if config.verbose:
            glog.info(plan_table(plan, world))
        glog.info(f"The losses and outputs below are rank 0's, over its {total // world} of the "
                  f"{total} images of each iteration")
        stats.extra["plan"] = [{"layer": p.info.name, "index": p.info.layer,
                                "shapes": p.info.shapes, "scheme": p.scheme,
                                "bytes_per_node": p.bytes_per_node, "predicted_s": p.predicted_s,
                                "ps_bytes": p.ps_bytes, "sfb_bytes": p.sfb_bytes,
                                "ring_bytes": p.ring_bytes} for p in plan.layers]
        stats.extra["units"] = [{"layers": layers, "scheme": scheme} for layers, scheme in plan.units]
        stats.extra["link"] = plan.link.as_dict()
        return plan

    max_frame = frame_limit(slots, world, config.chunk_bytes)
    shard = shards.start(
        ShardSettings(rank, config.timeout, max_frame, config.shard_threads, config.timeline,
                      config.startup_timeout),
        key, entries)
    shard_errors: list[str] = []
    ep = None

    def shard_failed(reason: str) -> None:  # e.g. its port is taken: stop now, not at timeout
        shard_errors.append(reason)
        if ep is not None:
            ep.fatal(reason)

    relay = ErrorRelay(on_error=shard_failed)
    relay.watch(shard)
    try:
        ep = open_worker(rank, entries, key=key, timeout=config.timeout, stats=stats,
                         startup=config.startup_timeout,
                         max_frame_bytes=max_frame,
                         # an elastic generation's error is no reason to resume by hand
                         snapshot_hint=None if wrap_sync is not None else
                         lambda: str(solver.last_snapshot or "none"))
        if exit_grace is not None:
            ForcedExit(exit_grace).attach(ep)
        if shard_errors:
            ep.fatal(shard_errors[0])
        if on_endpoint is not None:
            on_endpoint(ep)
        display = solver.param.display
        # rank 0's --stats: the CPU per iteration by kind of thread, and its shard's, from the
        # end of the first round (start-up and the first iteration's allocations left out)
        meter = CpuMeter(child=shard.pid) if config.stats is not None and rank == 0 else None

        def report(rnd: int) -> None:
            if meter is not None and rnd == 0:
                meter.begin()
            if rank == 0 and display and (rnd + 1) % display == 0:
                lines = stats.format_lines()
                for line in lines if config.verbose else lines[:1]:
                    glog.info(line)

        sync = Syncer(ep, slots, solver.update_layer, planner=planner, link=link,
                      levels=config.levels, chunk_bytes=config.chunk_bytes,
                      priority=config.priority, on_round_done=report, engines=allowed,
                      required_engines=required, on_gpu=gpu is not None)
        attached = wrap_sync(ep, sync) if wrap_sync is not None else sync
        solver.attach_sync(attached, momentum_by_sync=sync.momentum_layers, workers=sync.world)
        try:
            yield
        except CommError:
            raise
        except Exception as e:  # e.g. a snapshot on a full disk: every rank stops, naming it
            ep.fatal(f"{ep.name}: {e}")
            ep.disarm()
            raise
        if meter is not None:  # read while the communicator's threads and the shard live
            stats.extra["cpu_s_per_iter"] = meter.end(int(stats.summary()["iterations"]) - 1)
        solver.close()  # the last updates, the replica check, BYE; then the shard ends
        shard_ended(shard, config.timeout,
                    f"shard {rank} ({entries[rank].host}:{entries[rank].shard_port})")
    finally:
        solver.close()  # on failure: stop the comm threads so the process can exit
        if config.stats is not None and rank == 0:
            stats.write_json(config.stats)
        if shard.poll() is None:
            shard.kill()  # it ignores the polite signals (see shard.py); it holds nothing to save
            shard.wait()


def shard_ended(shard: subprocess.Popen, timeout: float, name: str) -> None:
    """Wait for the shard to end once its worker said BYE; a CommError naming it where it
    failed or outlived ``timeout`` (it waits for every worker's BYE, and a worker killed
    without one is only declared silent after the same time-out, later on a busy machine:
    an elastic generation's survivors then end as failed, where the wait's own exception
    ended their process)."""
    try:
        shard.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommError(f"{name} did not end within {timeout:g} s of its worker's BYE (it "
                        "waits for every worker's BYE, or for a silent one's time-out)") from None
    if shard.returncode:
        raise CommError(f"{name} exited with code {shard.returncode}")


def run_managed(config: JobConfig, placement: Placement) -> None:
    """Be the worker a cluster manager started: meet the others at the rendezvous, train."""
    from .rendezvous import meet
    from .tables import check_pinned, gpus_of

    key = require_key(config)
    gpus = config.gpus
    if config.pin_gpus and gpus is not None and placement.local_size not in (None, len(gpus)):
        raise CommError(f"{placement.manager} runs {placement.local_size} workers on this "
                        f"machine, but --gpus {','.join(map(str, gpus))} pins one worker to "
                        f"each of {len(gpus)} GPUs")
    entries = meet(placement, key, config.startup_timeout)
    if placement.rank == 0:
        from engine import glog
        from engine.comm.hosts import machines
        counts = [len(m) for m in machines(entries)]
        host, port = placement.master or ("?", 0)
        glog.info(f"Rendezvous ({placement.manager}) at {host}:{port}: "
                  f"{plural(len(entries), 'worker')} on {plural(len(counts), 'machine')} "
                  f"({', '.join(map(str, counts))} workers)")
    if config.pin_gpus and gpus is not None:
        check_pinned(entries, gpus)
    run_worker(config, entries, placement.rank, gpus_of(entries, config)[placement.rank])


def recorded_plan(config: JobConfig, infos: list[Any], entries: list[Any], allow_sfb: bool,
                  on_gpu: bool, momentum: float, strict: bool = True) -> tuple[Any, str] | None:
    """Rank 0's plan to follow, and why, when the run has one: ``--plan``'s (a CommError when it
    does not fit, unless not ``strict``), else the resumed snapshot's where it fits (where not,
    one line says why and the run plans anew). None: plan from the link."""
    from engine import glog
    from engine.caffe_io import FormatError
    from engine.comm.plan_file import read_plan
    from engine.comm.plan_file import recorded_plan as snapshot_plan
    from engine.comm.planner import EngineMismatch, PlanMismatch, pin_plan

    source = config.plan or config.snapshot
    if source is None:
        return None
    try:
        recorded = read_plan(source) if config.plan else snapshot_plan(source)
    except FormatError as e:
        if config.plan:
            raise CommError(f"--plan: {e}") from None
        glog.warning(f"{e}: planning anew")
        return None
    if recorded is None:
        return None
    try:
        plan = pin_plan(recorded, infos, len(entries),
                        plan_options(config, entries, allow_sfb, on_gpu, momentum,
                                     versions_of=[e.name for e in recorded.engines]))
    except EngineMismatch as e:
        raise CommError(f"{'--plan ' if config.plan else 'the plan recorded in '}{source}: "
                        f"{e}") from None
    except PlanMismatch as e:
        if config.plan and strict:
            raise CommError(f"--plan {config.plan} does not fit this run: {e}") from None
        glog.info(f"The plan recorded in {source} does not fit this run ({e}): planning anew")
        return None
    return plan, (f"pinned by --plan {source}" if config.plan else
                  f"recorded in {source}: the resumed run sums as the run that wrote it")


def plan_options(config: JobConfig, entries: list[Any], allow_sfb: bool, on_gpu: bool,
                 momentum: float, net: Any = None, infos: list[Any] | None = None,
                 link: Any = None, local_link: Any = None, engines: Any = (),
                 versions_of: Any = (), crowding: float = 1.0, shm_probe: Any = None) -> Any:
    """Rank 0's PlanOptions: the job's settings, this machine's probed speeds, where the
    workers are, the links (when known), the engines every worker joined (priced by their
    probes) and, with fusion and a ``net``, the backward time of every layer estimated from
    its arithmetic (for --fusion-ms). ``momentum``: what the sparse codec applies (its
    momentum correction; 0: none). ``versions_of``: the engines whose version and pinned
    algorithm this machine is asked for (a recorded plan's). ``crowding``: workers per core
    on this machine; ``shm_probe``: shm's start-up probe, where it ran."""
    from engine.comm.planner import DEFAULT_LINK, DEFAULT_LOCAL_LINK, PlanOptions
    from engine.comm.probe import probe_device
    from engine.comm.schemes import SCHEMES
    from engine.comm.topology import Topology

    device = probe_device(on_gpu)
    backward_s = None
    if config.fusion_mb > 0 and net is not None:
        from engine.perf.flops import DeviceSpeed, trace_from_flops
        from engine.perf.netinfo import facts_of
        speed = DeviceSpeed(device.name, device.gemm_flops_per_s, device.add_bytes_per_s / 3)
        trace = trace_from_flops(facts_of(net, infos), speed)
        backward_s = tuple(t.backward_ms / 1e3 for t in trace.layers)
    topo = Topology.of(entries, 0)
    versions = []
    for name in versions_of:
        backend = SCHEMES[name].backend if name in SCHEMES and SCHEMES[name].engine else None
        if backend is not None and not backend.missing(on_gpu):
            versions.append((name, backend.version(), backend.algorithm()))
    return PlanOptions(
        engines=tuple(engines), trusted_engines=config.engines[0],
        engine_versions=tuple(versions),
        comm=config.comm, allow_sfb=allow_sfb, link=link or DEFAULT_LINK,
        local_link=local_link or DEFAULT_LOCAL_LINK, device=device,
        chunk_bytes=config.chunk_bytes, codec=config.codec,
        sparse=(config.sparse, config.sparse_warmup, momentum),
        fusion_bytes=int(config.fusion_mb * (1 << 20)), fusion_s=config.fusion_ms / 1e3,
        backward_s=backward_s, slots=topo.slots if config.levels and topo.two_level else 1,
        machines=len(topo.machines), crowding=crowding, shm_probe=shm_probe)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m poseidon_cli.launch.worker")
    ap.add_argument("--rank", type=int, default=None,
                    help="this worker's rank in the host table on standard input (without it: "
                    "the rank from the manager's variables, the table from the rendezvous)")
    ap.add_argument("--gpu", type=int, default=None)
    args = ap.parse_args(argv)

    with user_errors():
        # not on the command line, where `ps` shows it to every user of the machine
        line = sys.stdin.readline()
        if not line.strip():
            raise CommError("no job configuration on standard input: a worker is started by "
                            "`poseidon train` (its launcher writes the configuration there)")
        config = JobConfig.from_json(line)
        if args.rank is None:
            placement = detect(os.environ)
            if not isinstance(placement, Placement):
                raise CommError("a worker without --rank takes its place from a cluster "
                                "manager's variables (RANK, WORLD_SIZE, ...): none are set")
            run_managed(config, placement)
            return
        entries = table_from_json(sys.stdin.readline(), "the host table on standard input")
        if not 0 <= args.rank < len(entries):
            raise CommError(f"--rank {args.rank} out of range: {config.hosts} lists "
                            f"{len(entries)} workers")
        run_worker(config, entries, args.rank, args.gpu)


if __name__ == "__main__":
    run_process(main)
