"""One training process, the composition root of `poseidon train`: a single process, or one
worker of a distributed run. Here the engine (a Solver), the command line's progress bar and
signals, the timeline and, for a worker, the communicator (``attach``) are put together; the
engine knows none of them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

from engine.context import RunContext

from .job_config import JobConfig
from .progress import ProgressBar
from .signals import signal_requests

#: what a distributed worker plugs in around training: given the built solver, a context
#: entered before it trains (the shard, the endpoint, the syncer attached) and left after
Attach = Callable[[Any], ContextManager[Any]]


def build_solver(config: JobConfig, context: RunContext) -> Any:
    """The Solver of ``config``: Caffe's, or one replaying traced layer times (--replay)."""
    # caffe train's -level and -stage: the solver's train_state, as Caffe's tool sets it
    state = dict(train_level=config.level,
                 train_stages=[s for given in config.stage for s in given.split(",") if s])
    if config.replay is not None:
        from engine.perf.replay import make_solver
        return make_solver(config.solver, config.replay, config.time_scale, context=context,
                           is_root=context.rank == 0, **state)
    from engine.solver import Solver
    return Solver(config.solver, context=context, is_root=context.rank == 0, **state)


def train_process(config: JobConfig, context: RunContext, gpu: int | None,
                  attach: Attach | None = None, timeline_parts: int = 1) -> None:
    """Train ``config``'s solver as rank ``context.rank`` on ``gpu`` (None: the CPU), with
    Caffe's log lines, snapshots and signal effects; ``attach``: a distributed worker's
    communicator. Rank 0 draws the progress bar and merges ``timeline_parts`` parts of the
    timeline (the processes of its machine)."""
    from engine import backend, glog, timeline

    if gpu is not None:
        backend.use_gpu(gpu, config.gpu_math)
        glog.info(f"Use GPU with device ID {gpu}")
        glog.info(backend.gpu_math_line())
    else:
        glog.info("Use CPU.")
    solver = build_solver(config, context)
    root = context.rank == 0
    if root:
        solver.add_callback(ProgressBar())  # drawn only when stderr is a terminal
    try:
        for w in config.weights:
            solver.load_weights(w)
        if config.snapshot is not None and root:
            say_if_the_batch_changes(config.snapshot, solver, context.world_size)
        if config.timeline is not None:
            name = f"worker {context.rank}" if attach else "train"
            timeline.start(config.timeline, name, f"worker{context.rank}" if attach else "rank0")
        glog.info("Starting Optimization")
        with attach(solver) if attach else contextlib.nullcontext():
            with signal_requests(solver, config.signal_effects, then_ignore=attach is not None):
                solver.solve(config.snapshot)
    finally:
        solver.close()  # on failure too: the comm and prefetch threads stop, the process exits
        if config.timeline is not None:
            timeline.current.save_part()
            if root:
                timeline.merge(config.timeline, expected=timeline_parts)


def say_if_the_batch_changes(snapshot: str, solver: Any, world: int) -> None:
    """One warning when ``snapshot`` was written by another number of workers than this run
    has (its recorded plan says how many; none recorded: one): each iteration then trains on
    another global batch than the run being resumed did, silently otherwise."""
    from engine import glog
    from engine.caffe_io import FormatError
    from engine.comm.plan_file import recorded_plan

    try:
        plan = recorded_plan(snapshot)
    except FormatError:
        return  # the restore names what is wrong with the file
    written_by = plan.world_size if plan is not None and plan.world_size else 1
    if written_by == world:
        return
    now = solver.images_per_iter()  # 0 for a net fed by Input layers, not a database
    change = (f"an iteration now trains on {now} images, not {now // world * written_by}"
              if now else f"the global batch is now {world}/{written_by} of what it was")
    workers = f"{written_by} worker{'s' * (written_by > 1)}"
    glog.warning(f"{snapshot} was written by {workers} and this run has {world}: {change} (the "
                 f"learning rate schedule counts iterations; resume on {workers} to keep the "
                 "batch)")
