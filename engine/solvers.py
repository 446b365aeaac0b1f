"""Caffe's update rules and learning-rate policies, computed in the parameters' dtype.

Each rule follows Caffe 1.0's ComputeUpdateValue literally (same operations in the same
order, float32 scalars), because small differences in rounding compound over iterations and
the oracle comparisons allow 1e-3. A rule overwrites ``diff`` with the value that the
update ``data -= diff`` subtracts, exactly as Caffe's SGDSolver family does.

History layout matches Caffe's solverstate: ``history[k * n + i]`` is the k-th history
blob of learnable parameter i (SGD, Nesterov, AdaGrad, RMSProp: k = 0 only; AdaDelta: k=1
holds the squared-update history; Adam: k=0 is m, k=1 is v).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .backend import get_array_module
from .kernels import cpu as compiled
from .pb import caffe_pb2


class SolverError(ValueError):
    """A solver definition Poseidon cannot run; the message names the field."""


f32 = np.float32

#: SolverParameter.solver_type (V1 enum) value -> the type string Caffe 1.0 uses
V1_SOLVER_TYPES = {0: "SGD", 1: "Nesterov", 2: "AdaGrad", 3: "RMSProp", 4: "AdaDelta", 5: "Adam"}

LR_POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def solver_type(param: Any) -> str:
    """The solver's type string, upgrading the V1 ``solver_type`` enum as Caffe does."""
    if param.HasField("solver_type"):
        old = V1_SOLVER_TYPES[param.solver_type]
        if param.HasField("type") and param.type != old:
            raise SolverError(f"solver: 'solver_type: {caffe_pb2.SolverParameter.SolverType.Name(param.solver_type)}' "
                              f"and 'type: \"{param.type}\"' disagree; give only 'type'")
        return old
    name = param.type or "SGD"
    if name not in RULES:
        raise SolverError(f"solver: unknown type \"{name}\" (known: {', '.join(RULES)})")
    return name


# ---------------------------------------------------------------------------------------
# Learning-rate policies (Caffe's SGDSolver::GetLearningRate)
# ---------------------------------------------------------------------------------------
def check_lr_policy(param: Any) -> None:
    """Reject a policy Caffe would abort on mid-run, before anything is trained."""
    policy = param.lr_policy
    if policy not in LR_POLICIES:
        raise SolverError(f"solver: unknown lr_policy \"{policy}\" (known: {', '.join(LR_POLICIES)})")
    if policy == "step" and param.stepsize <= 0:
        raise SolverError("solver: lr_policy \"step\" needs stepsize > 0")
    if policy == "poly" and param.max_iter <= 0:
        raise SolverError("solver: lr_policy \"poly\" needs max_iter > 0")


def learning_rate(param: Any, it: int, current_step: int) -> tuple[float, int]:
    """(rate at iteration ``it``, updated current_step) for ``param.lr_policy``.

    Where Caffe calls pow(float, int) C++ promotes to double; where both operands are
    float it stays float. Both are reproduced so the logged rates agree to the digit.
    """
    policy = param.lr_policy
    base = f32(param.base_lr)
    gamma = f32(param.gamma)
    power = f32(param.power)
    if policy == "fixed":
        rate = base
    elif policy == "step":
        current_step = it // param.stepsize
        rate = f32(float(base) * float(gamma) ** current_step)
    elif policy == "exp":
        rate = f32(float(base) * float(gamma) ** it)
    elif policy == "inv":
        rate = base * (f32(1) + gamma * f32(it)) ** (-power)
    elif policy == "multistep":
        # Caffe advances at most one step per call (so per iteration); kept as is.
        if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
            current_step += 1
        rate = f32(float(base) * float(gamma) ** current_step)
    elif policy == "poly":
        rate = base * (f32(1) - f32(it) / f32(param.max_iter)) ** power
    elif policy == "sigmoid":
        rate = base * (f32(1) / (f32(1) + np.exp(-gamma * (f32(it) - f32(param.stepsize)))))
    else:
        raise SolverError(f"solver: unknown lr_policy \"{policy}\"")
    return float(f32(rate)), current_step


# ---------------------------------------------------------------------------------------
# Gradient preprocessing shared by every rule (Caffe's Normalize, Regularize, ClipGradients)
# ---------------------------------------------------------------------------------------
def normalize(diff: Any, iter_size: int, workers: int = 1) -> None:
    """Gradients summed over iter_size passes, and over ``workers`` workers (the communicator
    delivers their sum), become their mean: the workers' first, as a divide, or, for a power
    of two, a multiply by its inverse, which is exact, so the same bits (a divide costs this
    CPU 2.3x a multiply over 1 MB)."""
    if workers > 1:
        if workers & (workers - 1):
            diff /= f32(workers)
        else:
            diff *= f32(1) / f32(workers)
    if iter_size > 1:
        diff *= f32(1) / f32(iter_size)


def regularize(data: Any, diff: Any, local_decay: float, kind: str) -> None:
    """diff += decay * data (L2) or decay * sign(data) (L1)."""
    if not local_decay:
        return
    decay = f32(local_decay)
    if kind == "L2":
        diff += decay * data
    elif kind == "L1":
        xp = get_array_module(data)
        diff += decay * xp.sign(data)
    else:
        raise SolverError(f"solver: unknown regularization_type \"{kind}\" (known: L1, L2)")


@dataclass(frozen=True)
class Preprocess:
    """Caffe's Normalize and Regularize of one parameter's gradient: what every rule's
    ``step`` does before its ``compute`` (SGD's does all of it in one pass). ``workers``: the
    gradient is the sum of that many workers' (the mean is taken here, in the pass the update
    makes anyway, not in a pass of the communicator's own)."""
    workers: int
    iter_size: int
    decay: float
    kind: str

    def apply(self, data: Any, diff: Any) -> None:
        normalize(diff, self.iter_size, self.workers)
        regularize(data, diff, self.decay, self.kind)


def clip_scale(diffs: Sequence[Any], clip: float) -> tuple[float, float] | None:
    """(global L2 norm, scale) when the norm exceeds ``clip`` >= 0, else None."""
    if clip < 0:
        return None
    sumsq = 0.0
    for d in diffs:
        xp = get_array_module(d)
        sumsq += float(xp.dot(d.ravel(), d.ravel()))
    norm = float(f32(math.sqrt(sumsq)))
    if norm <= clip:
        return None
    return norm, float(f32(clip) / f32(norm))


# ---------------------------------------------------------------------------------------
# Update rules
# ---------------------------------------------------------------------------------------
class UpdateRule:
    """One solver type: ``compute`` turns the (preprocessed) gradient into the update."""

    name = ""
    #: history blobs per learnable parameter in the solverstate
    histories = 1

    def __init__(self, param: Any):
        self.momentum = f32(param.momentum)
        self.delta = f32(param.delta)

    def step(self, data: Any, diff: Any, history: Sequence[Any], local_rate: float, it: int,
             pre: Preprocess) -> None:
        """Preprocess ``diff`` (``pre``), then overwrite it with the update."""
        pre.apply(data, diff)
        self.compute(diff, history, local_rate, it)

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        """Overwrite ``diff`` with the update; ``history`` are this parameter's blobs."""
        raise NotImplementedError


class SGD(UpdateRule):
    name = "SGD"

    def step(self, data: Any, diff: Any, history: Sequence[Any], local_rate: float, it: int,
             pre: Preprocess) -> None:
        # the mean, Normalize, L2's Regularize and the momentum in one pass where compiled
        if (pre.kind == "L2" or not pre.decay) and compiled.sgd_step(
                history[0], diff, data, pre.workers, pre.iter_size, f32(pre.decay),
                self.momentum, f32(local_rate)):
            return
        super().step(data, diff, history, local_rate, it, pre)

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        h = history[0]
        if compiled.sgd_step(h, diff, diff, 1, 1, f32(0), self.momentum, f32(local_rate)):
            return
        h *= self.momentum
        h += f32(local_rate) * diff
        diff[...] = h


class Nesterov(UpdateRule):
    name = "Nesterov"

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        h = history[0]
        previous = h.copy()
        h *= self.momentum
        h += f32(local_rate) * diff
        # update = (1 + momentum) * h_new - momentum * h_old
        previous *= -self.momentum
        previous += (f32(1) + self.momentum) * h
        diff[...] = previous


def _divide_by_root(diff: Any, h: Any, delta: Any, local_rate: float) -> None:
    """AdaGrad's and RMSProp's step, in place: diff = rate * diff / (sqrt(h) + delta),
    in Caffe's float32 order of operations."""
    update = get_array_module(diff).sqrt(h)
    update += delta
    diff /= update
    diff *= f32(local_rate)


class AdaGrad(UpdateRule):
    name = "AdaGrad"

    def __init__(self, param: Any):
        super().__init__(param)
        if param.momentum != 0:
            raise SolverError("solver: momentum cannot be used with AdaGrad")

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        h = history[0]
        h += diff * diff
        _divide_by_root(diff, h, self.delta, local_rate)


class RMSProp(UpdateRule):
    name = "RMSProp"

    def __init__(self, param: Any):
        super().__init__(param)
        if param.momentum != 0:
            raise SolverError("solver: momentum cannot be used with RMSProp")
        if not 0 <= param.rms_decay <= 1:
            raise SolverError(f"solver: rms_decay must be in [0, 1], got {param.rms_decay:g}")
        self.rms_decay = f32(param.rms_decay)

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        h = history[0]
        h *= self.rms_decay
        h += (f32(1) - self.rms_decay) * (diff * diff)
        _divide_by_root(diff, h, self.delta, local_rate)


class AdaDelta(UpdateRule):
    name = "AdaDelta"
    histories = 2

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        xp = get_array_module(diff)
        grad_h, update_h = history
        one_minus = f32(1) - self.momentum
        grad_h *= self.momentum
        grad_h += one_minus * (diff * diff)
        # sqrt((E[dx^2] + delta) / (E[g^2] + delta)), the delta guarding both
        ratio = (update_h + self.delta) / (grad_h + self.delta)
        diff *= xp.sqrt(ratio)
        update_h *= self.momentum
        update_h += one_minus * (diff * diff)
        diff *= f32(local_rate)


class Adam(UpdateRule):
    name = "Adam"
    histories = 2

    def __init__(self, param: Any):
        super().__init__(param)
        self.beta2 = f32(param.momentum2)

    def compute(self, diff: Any, history: Sequence[Any], local_rate: float, it: int) -> None:
        xp = get_array_module(diff)
        m, v = history
        beta1, beta2 = self.momentum, self.beta2
        t = it + 1
        # pow(float, int) is double in C++; the result is stored as float
        correction = f32(math.sqrt(1.0 - float(beta2) ** t) / (1.0 - float(beta1) ** t))
        m *= beta1
        m += (f32(1) - beta1) * diff
        v *= beta2
        v += (f32(1) - beta2) * (diff * diff)
        update = xp.sqrt(v)
        update += self.delta
        xp.divide(m, update, out=diff)
        diff *= f32(local_rate) * correction


RULES: dict[str, type[UpdateRule]] = {cls.name: cls for cls in
                                      (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam)}


def make_rule(param: Any) -> UpdateRule:
    """The update rule a SolverParameter asks for, its hyper-parameters checked."""
    return RULES[solver_type(param)](param)
