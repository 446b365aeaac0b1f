"""pycaffe's solvers: ``caffe.SGDSolver(file)`` ... ``caffe.AdamSolver(file)`` and ``get_solver``.

Each is the engine's Solver (engine/solver.py) with pycaffe's conventions: the class picks the
update rule whatever the file's ``type`` says (as Caffe's typed constructors do), relative
paths resolve against the working directory first (as Caffe's binaries do), the nets are
``caffe.Net`` (so ``solver.net.inputs``, ``solver.test_nets[0].forward(...)`` work), and
``apply_update`` computes the current learning rate itself, as Caffe's ApplyUpdate does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from engine.caffe_io import read_solver_prototxt
from engine.solver import Solver
from engine.solvers import learning_rate, solver_type

from .net import Net


class _Callback:
    """pycaffe's ``add_callback(on_start, on_gradients_ready)``: Caffe calls the first before
    each iteration's forward pass and the second after its backward pass."""

    def __init__(self, on_start: Callable[[], Any], on_gradients_ready: Callable[[], Any]):
        self._on_start, self._on_ready = on_start, on_gradients_ready

    def on_iteration_start(self, solver: Solver) -> None:
        self._on_start()

    def on_gradients_ready(self, solver: Solver) -> None:
        self._on_ready()


class SGDSolver(Solver):
    """Stochastic gradient descent with momentum, from a solver prototxt."""

    net_class = Net
    update_rule = "SGD"

    def __init__(self, filename: str | Path):
        super().__init__(str(filename), update_rule=self.update_rule, paths_from_cwd=True)

    @property
    def lr(self) -> float:
        """The learning rate at the current iteration (Caffe's GetLearningRate)."""
        return float(learning_rate(self.param, self.iter, self.current_step)[0])

    def apply_update(self) -> None:
        """Caffe's ApplyUpdate: the rate of the current iteration, then every parameter's update."""
        self._begin_update()
        super().apply_update()

    def add_callback(self, on_start: Any, on_gradients_ready: Callable[[], Any] | None = None
                     ) -> None:
        """pycaffe's two functions, or an engine callback object (one argument)."""
        if on_gradients_ready is None:
            super().add_callback(on_start)
        else:
            super().add_callback(_Callback(on_start, on_gradients_ready))

    def share_weights(self, net: Any) -> None:
        """Let ``net`` use this solver's train-net weights (no copy)."""
        net.share_weights_from(self.net)


class NesterovSolver(SGDSolver):
    update_rule = "Nesterov"


class AdaGradSolver(SGDSolver):
    update_rule = "AdaGrad"


class RMSPropSolver(SGDSolver):
    update_rule = "RMSProp"


class AdaDeltaSolver(SGDSolver):
    update_rule = "AdaDelta"


class AdamSolver(SGDSolver):
    update_rule = "Adam"


SOLVERS: dict[str, type[SGDSolver]] = {
    cls.update_rule: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver,
                                     AdaDeltaSolver, AdamSolver)}


def get_solver(filename: str | Path) -> SGDSolver:
    """The solver the file's ``type`` (or old ``solver_type``) names."""
    return SOLVERS[solver_type(read_solver_prototxt(Path(filename)))](filename)
