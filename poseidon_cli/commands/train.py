"""`poseidon train`: Caffe's `caffe train` — on one machine, or on many with --hosts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from ..console import fail, plural, user_errors

# SIGNAL_ACTIONS: Caffe's -sigint_effect / -sighup_effect values
from ..job_config import SIGNAL_ACTIONS, JobConfig, check_engines, cli_options
from ..launch.elastic.start import elastic_options, take_options
from ..warming import echo as warmup_echo
from ..warming import warm_kernels


def parse_gpus(text: str, flag: str = "--gpu") -> list[int]:
    """``flag`` (--gpu or --gpus): 'N', 'N,M,...' or 'all' (every GPU CuPy sees) as device
    ids; errors name the flag the user gave."""
    from engine import backend

    if text.strip().lower() == "all":
        if not backend.cupy_available():
            raise ValueError(f"{flag} all: CuPy sees no GPU here (train on the CPU: leave out "
                             f"{flag}; -n N runs N workers)")
        import cupy
        return list(range(cupy.cuda.runtime.getDeviceCount()))
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected a device id, a list such as 0,1, or "
                         "all") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{flag} {text!r}: device ids are 0 or more")
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


def job_options(command: Any) -> Any:
    """Add every JobConfig field that is an option of its own (job_config.py declares them)."""
    for name, decls, kwargs, default in reversed(cli_options()):
        command = click.option(*decls, name, default=default, **kwargs)(command)
    return command


@click.command("train")
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="The solver .prototxt (Caffe's, unchanged).")
@click.option("--weights", default=None,
              help="Fine-tune from these weights: a.caffemodel[,b.caffemodel...] (.h5 too).")
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
@click.option("--launch", type=click.Choice(["local", "ssh"]), default="local", show_default=True,
              help="How to start the workers on other hosts.")
@click.option("--sigint-effect", type=click.Choice(SIGNAL_ACTIONS), default="stop",
              show_default=True, help="What SIGINT (Ctrl-C) and SIGTERM do at the next "
              "iteration: snapshot then stop, snapshot and go on, or nothing (Caffe's flag).")
@click.option("--sighup-effect", type=click.Choice(SIGNAL_ACTIONS), default="snapshot",
              show_default=True, help="What SIGHUP does (Caffe's flag).")
@job_options
@elastic_options
def train(solver: str, weights: str | None, gpu: str | None, pin: str | None, hosts: str | None,
          host_list: str | None, nproc: int | None, rank: int | None, sparse: float | None,
          sparse_warmup: int | None, momentum_correction: bool | None, launch: str,
          sigint_effect: str, sighup_effect: str, **options: Any) -> None:
    """Train a net from a Caffe solver, with Caffe's log lines and snapshots."""
    with user_errors():
        elastic = take_options(options)
    snapshot, plan_file = options["snapshot"], options["plan"]
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
        gpus = parse_gpus(pin, "--gpus") if pin is not None else \
            parse_gpus(gpu) if gpu is not None else solver_gpu(solver)
    if sparse is None and (sparse_warmup is not None or momentum_correction is not None):
        fail("--sparse-warmup and --momentum-correction set up --sparse: give --sparse RATIO")
    if nproc is not None and (hosts is not None or rank is not None):
        fail("-n starts local workers on free ports: give -n or --hosts/--rank, not both")
    pinned = tuple(gpus or ()) if pin is not None else None
    from ..launch.managers import place_run
    if elastic is not None and rank is not None:
        fail("--rank places a worker in a fixed table; an elastic job's driver gives ranks")
    with user_errors():  # an elastic job's driver gives the ranks, not a manager's variables
        managed, nproc = place_run({} if elastic else os.environ, hosts, host_list, nproc,
                                   rank, pinned)
    distributed = hosts is not None or host_list is not None or nproc is not None or \
        managed is not None or elastic is not None
    if not distributed:
        for given, flag, why in ((sparse, "--sparse", "compresses the gradients workers "
                                  "exchange"),
                                 (options["key_file"], "--key-file", "authenticates the "
                                  "processes of a distributed run"),
                                 (plan_file, "--plan", "pins how the workers of a distributed "
                                  "run communicate")):
            if given is not None:
                fail(f"{flag} {why}: give --hosts or -n")
        if options["log_dir"] is not None:
            fail("--log-dir names the workers' logs of a distributed run: give --hosts or -n, "
                 "or redirect this process's stderr")
        if gpus is not None and len(gpus) > 1:
            fail(f"--gpu {gpu}: one process trains on one GPU; give --hosts to train on several")
    source = "" if not distributed else hosts or (
        f"-H {host_list}" if host_list else f"{managed.manager} job" if managed else
        f"-n {nproc}" if nproc else "elastic job")
    # SIGTERM (SLURM's and Kubernetes' notice before they kill) does what SIGINT does
    effects = {"SIGINT": sigint_effect, "SIGTERM": sigint_effect, "SIGHUP": sighup_effect}
    with user_errors():
        config = JobConfig(solver=solver, hosts=source, sparse=sparse or 0.0,
                           sparse_warmup=sparse_warmup or 0,
                           momentum_correction=momentum_correction is not False,
                           weights=tuple(weight_files),
                           gpus=tuple(gpus) if gpus is not None else None,
                           pin_gpus=pinned is not None, signal_effects=effects, **options)
        if distributed:
            check_engines(config, elastic is not None, gpus is not None)
        if nproc is not None and gpus is None:
            crowded = crowding(nproc)
            if crowded:
                click.echo(f"poseidon: note: {crowded}", err=True)
        if gpus is None and config.replay is None and rank is None and managed is None:
            # compiled here, once, not by each local worker in its first iterations
            warm_kernels(["float32"], warmup_echo, force=False)
        if elastic is not None:
            from ..launch.elastic.start import start
            start(config, elastic, hosts, host_list, nproc, launch)
        elif distributed:
            from ..launch import launcher
            launcher.start(config, managed, hosts, host_list, nproc, rank, launch)
        else:
            from engine.context import RunContext

            from ..training import train_process
            train_process(config, RunContext(), gpus[0] if gpus else None)


def crowding(workers: int) -> str | None:
    """When ``workers`` local CPU workers and what already runs outnumber this machine's
    cores: a line saying they share them (each worker gets less than a core: a run may be
    slower than one process); None where they fit."""
    cores = os.cpu_count() or 1
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if workers + busy <= cores + 0.5:
        return None
    return (f"{plural(workers, 'worker')} on {plural(cores, 'core')}, which other processes "
            f"already keep {busy:.1f} busy: they share them, each with about "
            f"{min(1.0, cores / (workers + busy)):.1f} of a core, so this run may be slower "
            "than one process (leave out -n); more workers help where they have cores of "
            "their own")
