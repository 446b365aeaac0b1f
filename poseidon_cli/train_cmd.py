"""`poseidon train`: Caffe's `caffe train` — on one machine, or on many with --hosts."""
from __future__ import annotations

import os
from pathlib import Path

import click

from engine.comm.codecs import CODECS
from engine.comm.planner import COMM_MODES

from .console import fail, user_errors

# SIGNAL_ACTIONS: Caffe's -sigint_effect / -sighup_effect values
from .launch.config import DEFAULT_SHARD_THREADS, SIGNAL_ACTIONS


def parse_gpus(text: str) -> list[int]:
    """``--gpu``: 'N', 'N,M,...' or 'all' (every GPU CuPy sees) as device ids."""
    from engine import backend

    if text.strip().lower() == "all":
        if not backend.cupy_available():
            raise ValueError("--gpu all: CuPy sees no GPU here")
        import cupy
        return list(range(cupy.cuda.runtime.getDeviceCount()))
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpu {text!r}: expected a device id, a list such as 0,1, or all") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"--gpu {text!r}: device ids are 0 or more")
    return ids


def solver_gpu(solver: str) -> list[int] | None:
    """The GPU a solver asks for, as Caffe reads it when no -gpu flag is given: an explicit
    ``solver_mode: GPU`` means device ``device_id`` (default 0). Without CuPy or a GPU here the
    run goes on on the CPU, and says so once."""
    from engine import backend
    from engine.caffe_io import read_solver_prototxt
    from engine.pb import caffe_pb2

    param = read_solver_prototxt(solver)
    if not (param.HasField("solver_mode") and param.solver_mode == caffe_pb2.SolverParameter.GPU):
        return None
    if backend.cupy_available():
        return [int(param.device_id)]
    click.echo(f"poseidon: warning: {solver} sets solver_mode: GPU, but CuPy or a GPU is "
               "missing here: training on the CPU", err=True)
    return None


@click.command("train")
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="The solver .prototxt (Caffe's, unchanged).")
@click.option("--weights", default=None,
              help="Fine-tune from these weights: a.caffemodel[,b.caffemodel...] (.h5 too).")
@click.option("--snapshot", default=None, type=click.Path(dir_okay=False),
              help="Resume from this .solverstate (or .solverstate.h5).")
@click.option("--gpu", default=None, metavar="N|N,M,..|all",
              help="Train on this GPU (needs CuPy); with --hosts, the local workers take the "
              "listed GPUs (or all) round robin.")
@click.option("--gpus", "pin", default=None, metavar="N,M,..|all",
              help="One worker per listed GPU on every machine (alone: on this machine).")
@click.option("--hosts", default=None, type=click.Path(dir_okay=False),
              help="Hosts file: train data-parallel on every host listed (a line may say "
              "slots=N: N workers there).")
@click.option("-H", "--host-list", default=None, metavar="HOST[:N],...",
              help="Machines and their worker counts, as horovodrun's -H: host1:4,host2:4.")
@click.option("-n", "--np", "--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="Train data-parallel on this many local workers, on free ports (no hosts "
              "file).")
@click.option("--rank", type=int, default=None,
              help="This process's rank in the hosts file (default: launch the local entries).")
@click.option("--comm", default="auto", show_default=True, metavar="MODE[,LAYER=SCHEME...]",
              help=f"Gradient communication per layer ({'|'.join(COMM_MODES)}): the fastest of "
              "the schemes by the cost model (auto), Poseidon's PS/SFB choice by bytes "
              "(hybrid), or one scheme wherever the layer allows it; then layers given a "
              "scheme by name (ip1=sfb).")
@click.option("--levels/--no-levels", default=True, show_default=True,
              help="With several workers per machine, reduce inside each machine first and send "
              "one copy per machine (--no-levels: every worker a node of its own).")
@click.option("--wire", type=click.Choice(list(CODECS)), default="fp32", show_default=True,
              help="Gradients on the wire: float32, or float16 (half the bytes; sums in "
              "float32; an overflow skips that layer's update and halves its scale).")
@click.option("--sparse", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=None,
              metavar="RATIO", help="Coarse-grained sparse communication: per PS / ring layer and "
              "iteration only this fraction of 256-value chunks travels, those with the largest "
              "L1 norm over all workers (plus one float per chunk); the rest waits in a local "
              "residual. float32 values (not with --wire fp16); SFB layers stay dense.")
@click.option("--sparse-warmup", type=click.IntRange(min=0), default=None, metavar="N",
              help="With --sparse: the first N iterations send everything.  [default: 0]")
@click.option("--momentum-correction/--no-momentum-correction", default=None,
              help="With --sparse: the residual accumulates SGD's momentum, which the solver "
              "then does not apply again (DGC's momentum correction; needs an SGD solver).  "
              "[default: on]")
@click.option("--fusion-mb", type=click.FloatRange(min=0), default=4.0, show_default=True,
              help="Fuse consecutive small PS / ring layers into buckets of at most this many "
              "MB (0: no fusion; 4 measured best, see the README).")
@click.option("--fusion-ms", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="A bucket's first layer waits at most this long (estimated) for its last.")
@click.option("--link", default=None, metavar="BW[@LATENCY]|FILE",
              help="Plan for this link (10gbit@50us, or a `poseidon bench comm --link-out` "
              "file) instead of probing it at start-up.")
@click.option("--plan", "plan_file", default=None, type=click.Path(dir_okay=False),
              help="Follow this communication plan (a run's <snapshot_prefix>_plan.prototxt, or "
              "a .solverstate) instead of planning from the link probe: two runs with one plan "
              "sum in the same order, bit for bit. A resumed run follows its snapshot's plan "
              "unless the workers differ.")
@click.option("--priority/--no-priority", default=True, show_default=True,
              help="When several layers wait to be sent, send the lowest (the next forward "
              "needs it first).")
@click.option("--key-file", default=None, type=click.Path(dir_okay=False),
              help="The job key every process authenticates its messages with (`poseidon "
              "keygen`; mode 600). Without it the launcher makes a fresh one for the workers it "
              "starts; workers started by hand (--rank) need it, or $POSEIDON_JOB_KEY.")
@click.option("--launch", type=click.Choice(["local", "ssh"]), default="local", show_default=True,
              help="How to start the workers on other hosts.")
@click.option("--stats", default=None, type=click.Path(dir_okay=False),
              help="Write communication counters as JSON here.")
@click.option("--timeout", type=float, default=30.0, show_default=True,
              help="Seconds before a silent peer is declared lost.")
@click.option("--chunk-bytes", type=int, default=4 << 20, show_default=True,
              help="Largest piece of a parameter one PS shard holds.")
@click.option("--shard-threads", type=click.IntRange(min=0), default=DEFAULT_SHARD_THREADS,
              show_default=True, help="Threads each PS shard sums its chunks on (chunks "
              "pinned to them, summed in place); 0: on its receive thread, as before.")
@click.option("--sigint-effect", type=click.Choice(SIGNAL_ACTIONS), default="stop",
              show_default=True, help="What SIGINT (Ctrl-C) and SIGTERM do at the next "
              "iteration: snapshot then stop, snapshot and go on, or nothing (Caffe's flag).")
@click.option("--sighup-effect", type=click.Choice(SIGNAL_ACTIONS), default="snapshot",
              show_default=True, help="What SIGHUP does (Caffe's flag).")
@click.option("--replay", default=None, type=click.Path(dir_okay=False),
              help="Replace each layer's compute by waiting its time in this trace (a "
              "poseidon-layer-trace or `poseidon time --json`); all else is real.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="With --replay: multiply every traced time by this.")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False),
              help="With --hosts or -n: each worker also writes its whole log (every rank's, "
              "not only rank 0's) to DIR/rank<N>.log.")
@click.option("--timeline", default=None, type=click.Path(dir_okay=False),
              help="Write Chrome trace events (Perfetto): layers, sends, sums, updates, per "
              "process and thread, merged across the ranks of this machine.")
def train(solver: str, weights: str | None, snapshot: str | None, gpu: str | None,
          pin: str | None, hosts: str | None, host_list: str | None, nproc: int | None,
          rank: int | None, comm: str, wire: str,
          sparse: float | None, sparse_warmup: int | None, momentum_correction: bool | None,
          fusion_mb: float, fusion_ms: float, link: str | None, plan_file: str | None,
          priority: bool, levels: bool,
          key_file: str | None, launch: str, stats: str | None,
          timeout: float, chunk_bytes: int, shard_threads: int, sigint_effect: str,
          sighup_effect: str, replay: str | None, time_scale: float, log_dir: str | None,
          timeline: str | None) -> None:
    """Train a net from a Caffe solver, with Caffe's log lines and snapshots."""
    if weights and snapshot:
        fail("give --weights (fine-tune) or --snapshot (resume), not both")
    if not Path(solver).is_file():
        fail(f"solver file {solver} not found")
    weight_files = [w for w in (weights or "").split(",") if w]
    for w in weight_files:
        if not Path(w).is_file():
            fail(f"--weights: {w} not found")
    if snapshot and not Path(snapshot).is_file():
        fail(f"--snapshot: {snapshot} not found")
    if plan_file and not Path(plan_file).is_file():
        fail(f"--plan: {plan_file} not found")
    if gpu is not None and pin is not None:
        fail("--gpu deals GPUs out round robin, --gpus pins one worker to each: give one")
    with user_errors():
        gpus = parse_gpus(pin or gpu) if (pin or gpu) is not None else solver_gpu(solver)
    # SIGTERM (SLURM's and Kubernetes' notice before they kill) does what SIGINT does
    effects = {"SIGINT": sigint_effect, "SIGTERM": sigint_effect, "SIGHUP": sighup_effect}
    if sparse is None and (sparse_warmup is not None or momentum_correction is not None):
        fail("--sparse-warmup and --momentum-correction set up --sparse: give --sparse RATIO")
    if nproc is not None and (hosts is not None or rank is not None):
        fail("-n starts local workers on free ports: give -n or --hosts/--rank, not both")
    pinned = tuple(gpus or ()) if pin is not None else None
    from .launch.managers import place_run
    with user_errors():
        managed, nproc = place_run(os.environ, hosts, host_list, nproc, rank, pinned)
    if hosts is not None or host_list is not None or nproc is not None or managed is not None:
        from .launch import launcher
        from .launch.config import JobConfig
        source = hosts or (f"-H {host_list}" if host_list else f"{managed.manager} job"
                           if managed else f"-n {nproc}")
        with user_errors():
            config = JobConfig(solver=solver, hosts=source, comm=comm, wire=wire,
                               sparse=sparse or 0.0, sparse_warmup=sparse_warmup or 0,
                               momentum_correction=momentum_correction is not False,
                               fusion_mb=fusion_mb, fusion_ms=fusion_ms, link=link,
                               plan=plan_file,
                               priority=priority, levels=levels, timeout=timeout,
                               chunk_bytes=chunk_bytes, shard_threads=shard_threads,
                               weights=tuple(weight_files),
                               snapshot=snapshot, gpus=tuple(gpus) if gpus is not None else None,
                               pin_gpus=pinned is not None,
                               stats=stats, signal_effects=effects, replay=replay,
                               time_scale=time_scale, timeline=timeline, log_dir=log_dir,
                               key_file=key_file)
            launcher.start(config, managed, hosts, host_list, nproc, rank, launch)
        return
    if sparse is not None:
        fail("--sparse compresses the gradients workers exchange: give --hosts or -n")
    if plan_file is not None:
        fail("--plan pins how the workers of a distributed run communicate: give --hosts or -n")
    if key_file is not None:
        fail("--key-file authenticates the processes of a distributed run: give --hosts or -n")
    if log_dir is not None:
        fail("--log-dir names the workers' logs of a distributed run: give --hosts or -n, or "
             "redirect this process's stderr")

    from engine import backend, glog
    from engine.solver import Solver

    from .progress import ProgressBar
    from .signals import signal_requests

    with user_errors():
        if gpus is not None:
            if len(gpus) > 1:
                fail(f"--gpu {gpu}: one process trains on one GPU; give --hosts to train on "
                     "several")
            backend.use_gpu(gpus[0])
            glog.info(f"Use GPU with device ID {gpus[0]}")
        else:
            glog.info("Use CPU.")
        if replay is not None:
            from engine.perf.replay import make_solver
            s = make_solver(solver, replay, time_scale)
        else:
            s = Solver(solver)
        s.add_callback(ProgressBar())
        try:
            for w in weight_files:
                s.load_weights(w)
            glog.info("Starting Optimization")
            if timeline is not None:
                from engine import timeline as tl
                tl.start(timeline, "train", "rank0")
            with signal_requests(s, effects):
                s.solve(snapshot)
        finally:
            s.close()
            if timeline is not None:
                tl.current.save_part()
                tl.merge(timeline, expected=1)
