"""InnerProduct, Caffe's fully connected layer, and the two *sufficient factors* of its weight
gradient, which it hands the distributed communicator (engine/factors.py: SFB sends them
instead of the gradient, and the layer may skip its own weight-gradient GEMM); and Embed, its
lookup-table form (InnerProduct on one-hot inputs)."""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from ..factors import FactorSpec, SufficientFactors
from ..fillers import fill
from .axes import canonical_axis, row_indices, scatter_add_rows
from .base import Layer, register
from .blas import accumulate_matmul


@register("InnerProduct", "INNER_PRODUCT")
class InnerProductLayer(Layer, SufficientFactors):
    """Fully connected: ``top = bottom · Wᵀ + b`` with the bottom flattened at ``axis`` to
    a (K, M) matrix (K rows = product of the dims before ``axis``, M inputs = product of the
    rest; DESIGN.md's names). W has shape (N, M) for N = num_output, or (M, N) with
    ``transpose: true`` (then ``top = bottom · W``).
    """

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.inner_product_param
        if p.num_output <= 0:
            raise self.fail("inner_product_param.num_output must be positive")
        self.num_output = p.num_output
        self.bias_term = p.bias_term
        self.transpose = p.transpose
        self.axis = canonical_axis(self, bottom[0], p.axis)
        self.inputs = bottom[0].count_range(self.axis)
        xp = backend.get_array_module(bottom[0].data)
        dtype = bottom[0].dtype
        w_shape = ((self.inputs, self.num_output) if self.transpose
                   else (self.num_output, self.inputs))
        self.blobs = [Blob(w_shape, dtype=dtype, xp=xp, name=f"{self.name}/0")]
        fill(p.weight_filler, self.blobs[0])
        if self.bias_term:
            self.blobs.append(Blob((self.num_output,), dtype=dtype, xp=xp, name=f"{self.name}/1"))
            fill(p.bias_filler, self.blobs[1])
        self.param_propagate_down = [True] * len(self.blobs)
        self._factors: tuple[Any, Any] | None = None
        self._scratch: dict[str, Any] = {}
        #: set by a communicator that rebuilds the weight gradient from the sufficient factors
        #: (SFB): backward then skips its weight-gradient GEMM, the largest product in it
        self.defer_weight_gradient = False

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        inputs = bottom[0].count_range(self.axis)
        if inputs != self.inputs:
            raise self.fail(f"input size incompatible with inner product parameters: bottom "
                            f"shape {bottom[0].shape} gives {inputs} inputs per row at axis "
                            f"{self.axis}, the weights expect {self.inputs}")
        self.rows = bottom[0].count_range(0, self.axis)
        top[0].reshape(bottom[0].shape[:self.axis] + (self.num_output,))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = backend.get_array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.rows, self.inputs)
        w = self.blobs[0].data
        y = top[0].data.reshape(self.rows, self.num_output)
        xp.matmul(x, w if self.transpose else w.T, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        xp = backend.get_array_module(top[0].diff)
        dy = top[0].diff.reshape(self.rows, self.num_output)
        x = bottom[0].data.reshape(self.rows, self.inputs)
        w = self.blobs[0]
        self._factors = None
        if self.param_propagate_down[0] and self.defer_weight_gradient:
            self.remember_factors(top, bottom)
        elif self.param_propagate_down[0]:
            # dW += dyᵀ·x (or its transpose), accumulated as Caffe's GEMM with beta = 1
            # (engine/layers/blas.py): no weight-sized temporary where BLAS allows
            if self.transpose:
                accumulate_matmul(x.T, dy, w.diff, self._scratch)
            else:
                accumulate_matmul(dy.T, x, w.diff, self._scratch)
            self.remember_factors(top, bottom)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            dx = bottom[0].diff.reshape(self.rows, self.inputs)
            xp.matmul(dy, w.data.T if self.transpose else w.data, out=dx)

    def remember_factors(self, top: Sequence[Blob], bottom: Sequence[Blob]) -> None:
        """This pass's (top diff, bottom data) as the factors; backward calls it, and so does
        replayed compute (engine/perf/replay.py), which computes no gradient."""
        self._factors = (top[0].diff.reshape(self.rows, self.num_output),
                         bottom[0].data.reshape(self.rows, self.inputs))

    def rebuild_gradient(self, u: Any, v: Any) -> None:
        """dW = the sum of every worker's uᵀ·v (vᵀ·u transposed), db = the sum of u's row
        sums: one product over all rows, in the order given, on the parameters' device."""
        xp = backend.get_array_module(self.blobs[0].diff)
        u, v = xp.asarray(u), xp.asarray(v)
        self.blobs[0].diff[...] = v.T @ u if self.transpose else u.T @ v
        if self.bias_term:
            self.blobs[1].diff[...] = u.sum(axis=0)

    def factor_spec(self) -> FactorSpec:
        """The shapes and orientation of the sufficient factors (after reshape)."""
        return FactorSpec(self.rows, self.inputs, self.num_output, bool(self.transpose))

    def sufficient_factors(self) -> tuple[Any, Any]:
        """The two factors of the weight gradient the last ``backward`` added.

        In DESIGN.md's notation (batch rows K, num_output N, inputs per row M) this returns
        ``(u, v)`` with ``u`` the top diff as a (K, N) matrix and ``v`` the bottom data as a
        (K, M) matrix, the batch dims before ``axis`` flattened into K. Without
        ``transpose`` the weight is (N, M) and the gradient this backward added to it is
        ``uᵀ · v``; with ``transpose: true`` the weight is (M, N) and the gradient added is
        ``vᵀ · u``. None of it includes the bias gradient (the sum of ``u``'s rows).

        Both are views of the blobs' arrays, not copies: they stay valid until the next
        forward writes the bottom (or the next backward writes the top diff). A caller that
        keeps them longer must copy them.
        """
        if self._factors is None:
            raise self.fail("sufficient_factors() needs a backward pass that computed the "
                            "weight gradient (param_propagate_down[0]) first")
        return self._factors


@register("Embed")
class EmbedLayer(Layer):
    """A lookup table: each bottom value is a row index into the (input_dim, num_output)
    weight, and the top, of shape bottom shape + (num_output,), holds that row plus the
    bias. InnerProduct on one-hot inputs, with the weight stored transposed; the index
    bottom takes no gradient."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.embed_param
        if p.num_output <= 0:
            raise self.fail("embed_param.num_output must be positive")
        if p.input_dim <= 0:
            raise self.fail("embed_param.input_dim (1 + the largest index) must be positive")
        self.num_output, self.input_dim = p.num_output, p.input_dim
        self.bias_term = p.bias_term
        xp = backend.get_array_module(bottom[0].data)
        dtype = bottom[0].dtype
        self.blobs = [Blob((self.input_dim, self.num_output), dtype=dtype, xp=xp,
                           name=f"{self.name}/0")]
        fill(p.weight_filler, self.blobs[0])
        if self.bias_term:
            self.blobs.append(Blob((self.num_output,), dtype=dtype, xp=xp, name=f"{self.name}/1"))
            fill(p.bias_filler, self.blobs[1])
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # Caffe checks these only in debug builds; a release build reads out of bounds
        self._index = row_indices(self, bottom[0].data, self.input_dim, "input",
                                   whole=True)
        y = top[0].data.reshape(self._index.size, self.num_output)
        y[...] = self.blobs[0].data[self._index]
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            raise self.fail("cannot backpropagate to the index input")
        dy = top[0].diff.reshape(self._index.size, self.num_output)
        if self.param_propagate_down[0]:
            scatter_add_rows(self.blobs[0].diff, self._index, dy)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)

    def allow_force_backward(self, bottom_index: int) -> bool:
        return False
