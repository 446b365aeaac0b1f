"""``sparse``: coarse-grained sparse communication (GradientFlow), with a residual and DGC's
momentum correction.

Each worker keeps, per unit, a residual ``v`` of what it has not sent yet. A round:

1. fold the local gradient ``g`` in: ``v += g`` (or, with momentum correction, ``u = m·u + g;
   v += u``, below);
2. cut ``v`` into chunks of ``CHUNK`` values (the last one padded with zeros) and sum the vector
   of their L1 norms over the workers (phase INDEX: one float per chunk, the index overhead);
3. every worker picks the same ``ceil(ratio · chunks)`` chunks with the largest summed norms
   (the norms are bit-identical everywhere; ties go to the lower chunk), packs them and sums the
   packed vector (phase VALUES); those values leave ``v``, the rest stays for later rounds;
4. the packed sums are unpacked into a zeroed vector: the unit's (sparse) gradient sum.

So a worker sends ``k·CHUNK + chunks`` values instead of ``count`` (both through the scheme, PS
or ring: the bytes counters read ``<scheme>`` and ``<scheme>/index``). The first ``warmup``
rounds are dense: all of ``v`` is summed (phase DENSE, so that PS's chunk table stays static),
and so is every round of a unit too small for a sparse round to send fewer values.

Why 256-value chunks: the index costs one float per chunk, 1/256 of the layer (0.4%, a
twenty-fifth of a 10% payload), while a chunk stays small beside a layer (LeNet's ip1 has 1,565
of them, conv2 98), so the choice is still close to picking values one by one.

Momentum correction (Lin et al., Deep Gradient Compression, 2018). Caffe's SGD applies momentum
to the summed gradient: ``h = m·h + rate·(g + decay·w)``. A value that waits k rounds in a plain
residual starts its momentum only when it is finally sent, so the steps momentum would have
taken meanwhile come later still. With the correction the codec keeps each worker's velocity
``u = m·u + g`` (``g`` regularized by the solver before release, since Caffe's momentum carries
the weight decay too), accumulates ``v += u`` and sends chunks of ``v``; the solver, told so
through ``Solver.attach_sync(momentum_by_sync=...)``, then updates those layers with
``data -= rate · mean`` and no history of its own. What has been applied plus the residuals is
then exactly the sum of the velocities, the total step of dense momentum SGD: only delayed,
never lost. Unlike DGC, ``u`` is not masked where a chunk was sent: DGC sends 0.1% of the values,
each rarely, while here a tenth of the chunks travels and the largest travel every round, so
masking would reset their momentum every round (plain SGD, a tenth of the step, where the
gradient matters most) and would drop momentum altogether in dense rounds. Unmasked, a dense
round is exactly momentum SGD. (Measured with benchmarks/bench_wire_accuracy.py, LeNet, 4
workers, 2,000 iterations: unmasked 0.08 points below dense fp32, masked 0.39 below.) The rate multiplies the velocity (as PyTorch's SGD does) rather
than each gradient inside it (as Caffe's does): the same for a fixed rate; under a decaying rate
older gradients take today's rate (LeNet's "inv" policy changes it by 7.5e-5 per iteration).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.pb import poseidon_pb2 as pb

from ..units import Unit
from .base import Codec, Finish, SumVector

f32 = np.float32


@dataclass
class _State:
    """One unit's buffers. Sent arrays (``norms``, ``packed``) are rewritten only by the next
    round, and a unit's next round starts only after its update (BSP per layer), when every send
    of this round has been received."""
    count: int
    chunks: int
    chosen: int | None  # chunks sent per sparse round; None: every round is dense
    residual: np.ndarray  # chunks x CHUNK values, the padding always zero
    velocity: np.ndarray | None
    norms: np.ndarray
    packed: np.ndarray
    summed: np.ndarray


class SparseCodec(Codec):
    name = "sparse"
    sums_as_given = False
    #: values per chunk (see the module docstring)
    CHUNK = 256

    def __init__(self, ratio: float, warmup: int = 0, momentum: float = 0.0) -> None:
        if not 0 < ratio < 1:
            raise ValueError(f"--sparse must be a fraction between 0 and 1, got {ratio:g}")
        if warmup < 0:
            raise ValueError(f"--sparse-warmup must be >= 0, got {warmup}")
        if not 0 <= momentum < 1:
            raise ValueError(f"the sparse codec's momentum must be in [0, 1), got {momentum:g}")
        self.ratio = ratio
        self.warmup = warmup
        self.momentum = momentum
        self._units: dict[int, _State] = {}
        self.sparse_rounds = 0
        self.dense_rounds = 0

    @classmethod
    def from_plan(cls, plan: Any) -> "SparseCodec":
        if plan is None:
            raise ValueError("the sparse codec takes its ratio from a plan")
        return cls(plan.sparse_ratio, plan.sparse_warmup, plan.sparse_momentum)

    def geometry(self, count: int) -> tuple[int, int | None]:
        """(chunks, chunks sent per sparse round) of a unit of ``count`` values; None when a
        sparse round would not send fewer values than a dense one."""
        chunks = math.ceil(count / self.CHUNK)
        chosen = math.ceil(self.ratio * chunks)
        return chunks, chosen if chosen * self.CHUNK + chunks < count else None

    def vectors(self, count: int) -> dict[int, int]:
        chunks, chosen = self.geometry(count)
        if chosen is None:
            return {pb.PHASE_DENSE: count}
        out = {pb.PHASE_VALUES: chosen * self.CHUNK, pb.PHASE_INDEX: chunks}
        if self.warmup:
            out[pb.PHASE_DENSE] = count
        return out

    def residual(self, unit_id: int) -> np.ndarray:
        """A copy of what this worker has not sent yet of unit ``unit_id``."""
        st = self._units[unit_id]
        return st.residual[:st.count].copy()

    def reduce(self, unit: Unit, rnd: int, vec: np.ndarray, bits: int, sum_vector: SumVector,
               finish: Finish) -> None:
        st = self._state(unit)
        n = st.count
        if st.velocity is not None:
            st.velocity *= f32(self.momentum)
            st.velocity += vec
            st.residual[:n] += st.velocity
        else:
            st.residual[:n] += vec
        if st.chosen is None or rnd < self.warmup:
            self.dense_rounds += 1
            vec[...] = st.residual[:n]  # ``vec`` is the scheme's: it may send it as it is
            st.residual[:n] = 0
            sum_vector(unit, rnd, pb.PHASE_DENSE, vec, bits, finish)
            return
        self.sparse_rounds += 1
        rows = st.residual.reshape(st.chunks, self.CHUNK)
        np.abs(rows).sum(axis=1, out=st.norms)
        chosen = st.chosen

        def norms_summed(norms: np.ndarray, bits: int) -> None:
            picked = np.sort(np.argsort(-norms, kind="stable")[:chosen])
            np.take(rows, picked, axis=0, out=st.packed.reshape(chosen, self.CHUNK))
            rows[picked] = 0  # sent: it leaves the residual

            def values_summed(total: np.ndarray, bits: int) -> None:
                st.summed.fill(0)
                st.summed.reshape(st.chunks, self.CHUNK)[picked] = total.reshape(chosen,
                                                                                 self.CHUNK)
                finish(st.summed[:n], bits)

            sum_vector(unit, rnd, pb.PHASE_VALUES, st.packed, bits, values_summed)

        sum_vector(unit, rnd, pb.PHASE_INDEX, st.norms, bits, norms_summed)

    def _state(self, unit: Unit) -> _State:
        st = self._units.get(unit.id)
        if st is None:
            chunks, chosen = self.geometry(unit.count)
            padded = chunks * self.CHUNK
            st = _State(unit.count, chunks, chosen, np.zeros(padded, f32),
                        np.zeros(unit.count, f32) if self.momentum else None,
                        np.zeros(chunks, f32), np.zeros((chosen or 0) * self.CHUNK, f32),
                        np.zeros(padded, f32))
            self._units[unit.id] = st
        return st

    def describe(self) -> str:
        return (f"sparse: the {100 * self.ratio:g}% of {self.CHUNK}-value chunks with the largest "
                f"L1 norm (+1 float per chunk), {self.warmup} dense warm-up rounds, "
                + (f"momentum correction {self.momentum:g}" if self.momentum
                   else "no momentum correction")
                + "; SFB layers stay dense; bytes below are dense")

    def report(self) -> dict[str, float]:
        return {"sparse_ratio": self.ratio, "sparse_chunk_values": self.CHUNK,
                "sparse_warmup": self.warmup, "sparse_momentum": self.momentum,
                "sparse_rounds": self.sparse_rounds, "sparse_dense_rounds": self.dense_rounds}
