"""The Solver: Caffe's training loop (nets from a SolverParameter, step, test, snapshot, restore).

Semantics are Caffe 1.0's solver.cpp / sgd_solver.cpp, line for line where it matters for the
numbers and the log (Caffe's tools parse the log). Two things go beyond Caffe:

- **A per-layer update, for the communicator.** ``update_layer(l)`` applies the update of the
  parameters that layer ``l`` owns. With a sync attached (``attach_sync``), the last backward
  pass of an iteration hands each finished layer to ``sync.release(l)``, which sums the
  gradients over the workers and calls ``update_layer(l)`` back (the update takes their mean,
  in the pass it makes anyway); the next forward calls ``sync.wait(l)`` before layer ``l``
  runs (wait-free backpropagation, DESIGN.md). A sync may
  take SGD's momentum over for some layers (sparse communication's momentum correction): their
  gradients are then regularized before release and updated without the solver's history.
- **Exact resume.** The solverstate records the train data layers' stream positions
  (SolverState.data_position, a Poseidon field Caffe ignores); a Caffe solverstate, which has
  none, resumes where Caffe's uninterrupted run would be: iter * batch * iter_size
  (engine/snapshots.py). Each iteration draws its randomness (dropout) from a stream of
  (random_seed, rank, iteration) alone, so there is no random state to save.

What is not the loop's job stays outside it, as in Caffe's caffe.cpp: signals and the
terminal's progress bar belong to the CLI, which asks for snapshots and stops through
``request`` and follows the run through ``add_callback``; only the caller decides what a
rank logs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Collection, Protocol, Sequence

import numpy as np

from . import backend, glog
from .context import RunContext
from .pb import caffe_pb2
from . import timeline
from .evaluation import TestResult, loss_weights, run_test_passes, score_line
from .solver_nets import SolverNets
from .solver_snapshots import SolverSnapshots
from .solvers import Preprocess, SolverError, clip_scale, learning_rate, make_rule, normalize, \
    solver_type

f32 = np.float32


class GradientSync(Protocol):
    """What the communicator plugs into the loop (engine.comm's syncer implements it)."""

    def release(self, layer_index: int) -> None:
        """Layer's local gradients are final: put every worker's sum in their place, then call
        ``solver.update_layer(layer_index)`` (on any thread)."""

    def wait(self, layer_index: int) -> None:
        """Block until the layer's update from the previous iteration is applied."""

    def wait_all(self) -> None:
        """Block until every released layer is updated."""

    def request(self, action: str) -> None:
        """A signal asked this process for ``action`` ('snapshot' or 'stop')."""

    def take_request(self) -> str | None:
        """The action every process agreed to take now, at this iteration boundary: 'snapshot',
        'stop' (snapshot, then stop), or 'end' (stop here without a snapshot: the caller goes
        on from a state it keeps itself, as elastic training's commit)."""

    def close(self) -> None:
        """Stop the communication threads."""

    def state(self) -> bytes:
        """What a snapshot records so that a resumed run synchronises exactly as this one
        (Poseidon's syncer: the communication plan); b"" when nothing."""


class Solver(SolverNets, SolverSnapshots):
    """Caffe's Solver for every update rule; only the root rank logs, tests and snapshots."""

    #: the class of the nets it builds (pycaffe's solvers build ``caffe.Net``); None: engine.net.Net
    net_class: type | None = None

    def __init__(self, solver: str | Path | Any, context: RunContext | None = None,
                 is_root: bool = True, *, update_rule: str | None = None,
                 paths_from_cwd: bool = False, train_level: int | None = None,
                 train_stages: Sequence[str] = ()):
        """``solver``: a solver prototxt or a SolverParameter. ``update_rule`` overrides the
        file's type (pycaffe's ``caffe.AdamSolver(file)`` is Adam whatever the file says).
        Relative paths in the solver (nets, snapshot_prefix) resolve beside the solver file
        first, then in the working directory; ``paths_from_cwd`` turns that round, as Caffe's
        own tools and pycaffe do. ``train_level`` and ``train_stages`` set and extend the
        solver's train_state (caffe train's -level and -stage)."""
        from . import caffe_io

        context = context or RunContext()
        if isinstance(solver, (str, Path)):
            path = Path(solver)
            if not path.is_file():
                raise SolverError(f"solver file {path} not found")
            self.source = str(path)
            param = caffe_io.read_solver_prototxt(path)
            base_dirs = [path.parent, *context.base_dirs]
        else:
            self.source = "<SolverParameter>"
            param = caffe_pb2.SolverParameter()
            param.CopyFrom(solver)
            base_dirs = list(context.base_dirs)
        if paths_from_cwd:
            base_dirs.insert(0, Path.cwd())
        elif Path.cwd() not in base_dirs and Path(".") not in base_dirs:
            base_dirs.append(Path.cwd())
        if update_rule is not None:
            param.ClearField("solver_type")
            param.type = update_rule
        if train_level is not None:
            param.train_state.level = train_level
        if train_stages:  # (extending by nothing would print an empty train_state in the log)
            param.train_state.stage.extend(train_stages)
        self.context = RunContext(context.rank, context.world_size, base_dirs)
        self.param = param
        self.is_root = is_root
        self._check_param()
        self._check_snapshot_prefix()
        self.type = solver_type(param)
        self.rule = make_rule(param)
        glog.info("Initializing solver from parameters: \n" + str(param))

        # Every replica must start from the same weights: build with the solver's seed; each
        # iteration then draws from its own stream of (seed, rank, iteration) (see step)
        if param.random_seed >= 0:
            backend.seed(param.random_seed)
        self._random_root = param.random_seed if param.random_seed >= 0 else backend.DEFAULT_SEED
        self.net = self._build_train_net()
        self.test_nets = self._build_test_nets()
        glog.info("Solver scaffolding done.")

        n = len(self.net.learnable_params)
        self.history: list[Any] = [backend.get_array_module(p.data).zeros_like(p.data)
                                   for _ in range(self.rule.histories)
                                   for p in self.net.learnable_params]
        self._layer_params: dict[int, list[int]] = {}
        for i, li in enumerate(self.net.param_layer_index):
            self._layer_params.setdefault(li, []).append(i)
        self._n_params = n
        self.iter = 0
        self.current_step = 0
        self.rate = 0.0
        self._update_iter = 0
        self.smoothed_loss = 0.0
        self._losses: list[float] = []
        self._sync: GradientSync | None = None
        #: how many workers' gradients the attached sync sums (attach_sync)
        self._workers = 1
        #: learnable params whose momentum the sync applies (attach_sync's momentum_by_sync)
        self._momentum_by_sync: frozenset[int] = frozenset()
        self._requests: list[str] = []
        #: the newest snapshot of this run (written, or resumed from); None before any
        self.last_snapshot: Path | None = None
        self._early_exit = False
        #: the sync ended the run at a boundary ('end'): no snapshot, no final test
        self._ended = False
        self._callbacks: list[Any] = []
        for w in param.weights:
            self.load_weights(self._resolve(w))

    def load_weights(self, path: str | Path) -> None:
        """Copy weights by layer name into the train net and every test net (Caffe's -weights)."""
        from .caffe_io import load_trained_weights

        path = Path(path)
        if not path.is_file():
            raise SolverError(f"weights file {path} not found")
        glog.info(f"Finetuning from {path}")
        load_trained_weights([self.net, *self.test_nets], path)

    # -- the sync hook --------------------------------------------------------------------
    def attach_sync(self, sync: GradientSync | None, momentum_by_sync: Collection[int] = (),
                    workers: int = 1) -> None:
        """Let ``sync`` sum gradients per layer and drive ``update_layer`` (None: detach).
        ``workers``: how many workers' gradients each of its sums holds (the update divides).

        ``momentum_by_sync``: layers whose SGD momentum ``sync`` applies itself, at the rate
        ``sync_momentum()`` gave it (engine/comm/codecs/sparse.py). Their gradients are
        normalized and regularized before release, since the momentum carries the weight decay
        as Caffe's does, and their update is ``data -= rate * diff``, without this solver's
        history."""
        if momentum_by_sync:
            self.sync_momentum()
        self._sync = sync
        self._workers = workers if sync is not None else 1
        self._momentum_by_sync = frozenset(i for layer in momentum_by_sync
                                           for i in self._layer_params.get(layer, ()))

    def sync_momentum(self) -> float:
        """The momentum a sync must apply when it takes this solver's momentum over; a
        SolverError when it cannot: only SGD's momentum is a velocity a sync can keep, and
        clipping needs every gradient before any update."""
        if self.type != "SGD":
            raise SolverError(f"solver {self.source}: momentum correction keeps SGD's momentum, "
                              f"and this solver is {self.type}")
        if self.param.clip_gradients >= 0:
            raise SolverError(f"solver {self.source}: momentum correction cannot clip gradients "
                              "(clip_gradients)")
        return float(self.param.momentum)

    def update_layer(self, layer_index: int) -> None:
        """Normalize, regularize, compute and apply the update of the params layer owns.

        With clip_gradients set this does nothing: clipping needs the global norm, so the
        loop applies every update at once (``apply_update``) after ``sync.wait_all()``.
        """
        if self.param.clip_gradients >= 0:
            return
        for i in self._layer_params.get(layer_index, ()):
            self._update_param(i, self._workers)

    def apply_update(self) -> None:
        """Caffe's ApplyUpdate for all parameters: clip, then each param's update."""
        params = self.net.learnable_params
        for p in params:  # the norm is the mean's: the workers' first
            normalize(p.diff, 1, self._workers)
        clipped = clip_scale([p.diff for p in params], self.param.clip_gradients)
        if clipped is not None:
            norm, scale = clipped
            glog.info(f"Gradient clipping: scaling down gradients (L2 norm {glog.fmt(norm)} > "
                      f"{glog.fmt(self.param.clip_gradients)}) by scale factor {glog.fmt(scale)}")
            for p in params:
                p.diff *= f32(scale)
        for i in range(self._n_params):
            self._update_param(i, 1)

    def _update_param(self, i: int, workers: int) -> None:
        """Param ``i``'s update, its gradient the sum of ``workers`` workers'."""
        blob = self.net.learnable_params[i]
        local_rate = float(f32(self.rate) * f32(self.net.params_lr[i]))
        if i in self._momentum_by_sync:  # the sync's mean is the velocity (see attach_sync)
            normalize(blob.diff, 1, workers)
            blob.diff *= f32(local_rate)
        else:
            hist = [self.history[k * self._n_params + i] for k in range(self.rule.histories)]
            self.rule.step(blob.data, blob.diff, hist, local_rate, self._update_iter,
                           self._preprocess(i, workers))
        blob.data -= blob.diff

    def _preprocess(self, i: int, workers: int) -> Preprocess:
        """Caffe's Normalize and Regularize of param ``i``'s gradient, the sum of
        ``workers``'."""
        p = self.param
        decay = float(f32(p.weight_decay) * f32(self.net.params_weight_decay[i]))
        return Preprocess(workers, p.iter_size, decay, p.regularization_type)

    def _release(self, layer_index: int) -> None:
        """Hand a layer's final gradients to the sync (the last backward pass's hook)."""
        for i in self._layer_params.get(layer_index, ()):
            if i in self._momentum_by_sync:
                blob = self.net.learnable_params[i]
                self._preprocess(i, 1).apply(blob.data, blob.diff)
        self._sync.release(layer_index)  # type: ignore[union-attr]

    def _begin_update(self) -> None:
        """Fix this iteration's rate before any of its updates can run (they may run on the
        communicator's thread while the main thread already starts the next iteration)."""
        step = self.current_step
        self.rate, self.current_step = learning_rate(self.param, self.iter, step)
        if self.param.lr_policy == "multistep" and self.current_step != step:
            glog.info(f"MultiStep Status: Iteration {self.iter}, step = {self.current_step}")
        self._update_iter = self.iter

    def _before_layer(self, layer_index: int) -> None:
        self._sync.wait(layer_index)
        # Caffe zeroes all diffs at the iteration's start; with a sync, a layer's previous
        # update may still be in flight then, so each layer is zeroed once it is done.
        for i in self._layer_params.get(layer_index, ()):
            self.net.learnable_params[i].diff[...] = 0

    def wait_all(self) -> None:
        """Wait for every layer's update in flight (none without a sync)."""
        if self._sync is not None:
            self._sync.wait_all()

    def sync_state(self) -> bytes:
        """The attached sync's state for a snapshot (b"" without a sync)."""
        return self._sync.state() if self._sync is not None else b""

    def close(self) -> None:
        """Stop an attached sync and the data layers' prefetch threads."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None
            self._workers = 1
        for net in [self.net, *self.test_nets]:
            for layer in net.data_layers:
                if hasattr(layer, "close"):
                    layer.close()

    # -- the loop ----------------------------------------------------------------------------
    def _forward_backward(self) -> float:
        """iter_size forward/backward passes; the last one releases layers to the sync."""
        sync = self._sync
        n = self.param.iter_size
        if sync is None:
            self.net.clear_param_diffs()
        loss = f32(0)
        for k in range(n):
            before = self._before_layer if sync is not None and k == 0 else None
            loss += f32(self.net.forward_prefilled(before_layer=before))
            if k == n - 1:
                self._begin_update()
            self.net.backward(on_layer_done=self._release if sync is not None and k == n - 1 else None)
        return float(loss / f32(n))

    def _update_smoothed_loss(self, loss: float, start_iter: int) -> None:
        average = self.param.average_loss
        if len(self._losses) < average:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = float((f32(self.smoothed_loss) * f32(size - 1) + f32(loss)) / f32(size))
        else:
            idx = (self.iter - start_iter) % average
            self.smoothed_loss = float(f32(self.smoothed_loss) + (f32(loss) - f32(self._losses[idx])) / f32(average))
            self._losses[idx] = loss

    def _take_request(self) -> str | None:
        if self._sync is not None:  # every worker must act at the same iteration
            return self._sync.take_request()
        return self._requests.pop(0) if self._requests else None

    def step(self, iters: int) -> None:
        """Run ``iters`` iterations (Caffe's Solver::Step)."""
        if iters < 0:
            raise SolverError(f"iterations must be >= 0, got {iters}")
        p = self.param
        start_iter = self.iter
        stop_iter = self.iter + iters
        self._losses = []
        self.smoothed_loss = 0.0
        timer = time.perf_counter()
        iter_last = self.iter
        while self.iter < stop_iter:
            tl = timeline.current
            iteration_start = tl.now()
            if p.test_interval and self.iter % p.test_interval == 0 and \
                    (self.iter > 0 or p.test_initialization):
                if self.is_root:
                    self.wait_all()
                    self.test_all()
                if self._early_exit:
                    break
            display = bool(p.display) and self.iter % p.display == 0
            self._call("on_iteration_start")
            backend.seed_iteration(self._random_root, self.context.rank, self.iter)
            loss = self._forward_backward()
            self._call("on_gradients_ready")
            self._update_smoothed_loss(loss, start_iter)
            if display:
                lapse = time.perf_counter() - timer
                per_s = (self.iter - iter_last) / (lapse or 1.0)
                glog.info(f"Iteration {self.iter} ({glog.fmt(per_s)} iter/s, {glog.fmt(lapse)}s/"
                          f"{p.display} iters), loss = {glog.fmt(self.smoothed_loss)}")
                timer = time.perf_counter()
                iter_last = self.iter
                self._log_outputs()
                glog.info(f"Iteration {self.iter}, lr = {glog.fmt(self.rate)}")
            if self._sync is None:
                self.apply_update()
            elif p.clip_gradients >= 0:
                self._sync.wait_all()
                self.apply_update()
            self.iter += 1
            if tl.active:
                tl.complete(f"iteration {self.iter - 1}", "iteration", iteration_start)
            self._call("on_iteration", loss)
            request = self._take_request()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == "snapshot":
                self.snapshot()
            if request in ("stop", "end"):
                self._early_exit = True
                self._ended = request == "end"
                break

    def _log_outputs(self) -> None:
        weights = loss_weights(self.net)
        k = 0
        for name in self.net.output_blob_names:
            for value in backend.to_numpy(self.net.blobs[name].data).astype(np.float32).ravel():
                glog.info(f"    Train net output #{k}: {score_line(name, float(value), weights.get(name, 0.0))}")
                k += 1

    def solve(self, resume_file: str | Path | None = None) -> None:
        """Train to max_iter (Caffe's Solver::Solve), resuming from a solverstate if given."""
        p = self.param
        glog.info(f"Solving {self.net.name}")
        glog.info(f"Learning Rate Policy: {p.lr_policy}")
        self._early_exit = False
        self._ended = False
        if resume_file is not None:
            glog.info(f"Restoring previous solver status from {resume_file}")
            self.restore(resume_file)
        start_iter = self.iter
        self._call("on_start")
        try:
            self.step(p.max_iter - self.iter)
            if self._ended:  # the caller ends the run here and keeps the state itself
                return
            self.wait_all()
            # a stop request (SIGINT) snapshots even when snapshot_after_train is off
            if (p.snapshot_after_train or self._early_exit) and \
                    (not p.snapshot or self.iter % p.snapshot != 0):
                self.snapshot()
            if self._early_exit:
                glog.info("Optimization stopped early.")
                return
            if p.display and self.iter % p.display == 0:
                loss = self.net.forward_prefilled()
                self._update_smoothed_loss(loss, start_iter)
                glog.info(f"Iteration {self.iter}, loss = {glog.fmt(self.smoothed_loss)}")
            if p.test_interval and self.iter % p.test_interval == 0 and self.is_root:
                self.test_all()
            glog.info("Optimization Done.")
        finally:
            self._call("on_end")

    # -- testing ----------------------------------------------------------------------------
    def test_all(self) -> list[TestResult | None]:
        """Test every test net once (root only); a stop request ends it early."""
        results = []
        for i in range(len(self.test_nets)):
            if self._early_exit:
                break
            results.append(self.test(i))
        return results

    def _handle_requests_while_testing(self) -> bool:
        while (request := self._take_request()) is not None:
            if request == "snapshot":
                self.snapshot()
            else:
                self._early_exit = True
                self._ended = request == "end"
        return self._early_exit

    def test(self, test_net_id: int = 0) -> TestResult | None:
        """Caffe's Solver::Test: test_iter forward passes with the train net's weights."""
        glog.info(f"Iteration {self.iter}, Testing net (#{test_net_id})")
        net = self.test_nets[test_net_id]
        net.share_weights_from(self.net)
        result = run_test_passes(net, self.param.test_iter[test_net_id],
                                 interrupted=self._handle_requests_while_testing)
        if result is None:
            glog.info("Test interrupted.")
            return None
        if self.param.test_compute_loss:
            glog.info(f"Test loss: {glog.fmt(result.loss)}")
        for k, (name, value, weight) in enumerate(result.scores):
            glog.info(f"    Test net output #{k}: {score_line(name, value, weight)}")
        return result

    # -- requests and callbacks --------------------------------------------------------------
    def request(self, action: str) -> None:
        """Ask the loop to 'snapshot' (and go on) or 'stop' (snapshot and stop) at the next
        iteration boundary: what the CLI's signal handlers do (Caffe's action_request_function).
        Safe to call from a signal handler."""
        if action not in ("snapshot", "stop"):
            raise ValueError(f"unknown solver action {action!r}")
        self._requests.append(action)
        if self._sync is not None:
            self._sync.request(action)

    def add_callback(self, callback: Any) -> None:
        """Call ``callback.on_start(solver)``, ``.on_iteration(solver, loss)`` and
        ``.on_end(solver)`` (those it has) around ``solve``, and in each iteration of ``step``
        ``.on_iteration_start(solver)`` before the forward pass and
        ``.on_gradients_ready(solver)`` after the backward pass (Caffe's Solver::Callback): how
        the CLI draws its progress bar without the solver knowing a terminal."""
        self._callbacks.append(callback)

    def _call(self, event: str, *args: Any) -> None:
        for cb in self._callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                fn(self, *args)

    def images_per_iter(self) -> int:
        """Images per iteration over all workers (the first data layer's stride x iter_size)."""
        layers = self.net.data_layers
        per_pass = sum(getattr(l, "step", 0) for l in layers[:1])
        return per_pass * self.param.iter_size
