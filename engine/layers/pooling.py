"""Pooling layers: Pooling (MAX with its optional mask top, AVE; pad, stride, global pooling)
and SPP (spatial pyramid pooling: pooling at several grid sizes, flattened and joined), with
Caffe's numerics. The window kernels are pool.py's."""
from __future__ import annotations

from typing import Any, Sequence

from .. import backend
from ..blob import Blob
from ..kernels.geometry import Geometry, pool_out_size
from ..pb import caffe_pb2
from . import pool
from .base import Layer, LayerError, register

_POOL = caffe_pb2.PoolingParameter
_SPP = caffe_pb2.SPPParameter


@register("Pooling", "POOLING")
class PoolingLayer(Layer):
    """Caffe's Pooling: MAX (optional mask top) and AVE, with pad, stride and global pooling."""

    exact_num_bottoms = 1
    min_tops = 1

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        # only MAX pooling has the optional second top (the argmax mask)
        self.max_tops = 2 if self.param.pooling_param.pool == _POOL.MAX else 1
        super().check_blob_counts(bottom, top)

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.pooling_param
        self.method = p.pool
        if self.method == _POOL.STOCHASTIC:
            raise self.fail("STOCHASTIC pooling is not supported (Caffe has no CPU form of it)")
        has = p.HasField
        self.global_pooling = bool(p.global_pooling)
        if self.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                raise self.fail("with global_pooling: true, the filter size cannot be specified")
        else:
            if has("kernel_size") == (has("kernel_h") and has("kernel_w")):
                raise self.fail("filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not (has("kernel_size") or (has("kernel_h") and has("kernel_w"))):
                raise self.fail("for non-square filters both kernel_h and kernel_w are required")
        for name in ("pad", "stride"):
            if not ((not has(name) and has(f"{name}_h") and has(f"{name}_w"))
                    or (not has(f"{name}_h") and not has(f"{name}_w"))):
                raise self.fail(f"{name} is {name} OR {name}_h and {name}_w are required")
        if has("kernel_size"):
            self.kernel = (int(p.kernel_size), int(p.kernel_size))
        else:
            self.kernel = (int(p.kernel_h), int(p.kernel_w))
        self.pad = (int(p.pad_h), int(p.pad_w)) if has("pad_h") else (int(p.pad), int(p.pad))
        self.stride = ((int(p.stride_h), int(p.stride_w)) if has("stride_h")
                       else (int(p.stride), int(p.stride)))
        if self.global_pooling:
            if self.pad != (0, 0) or self.stride != (1, 1):
                raise self.fail("with global_pooling: true, only pad = 0 and stride = 1")
        elif min(self.kernel) <= 0:
            raise self.fail(f"filter dimensions cannot be zero, got {self.kernel}")
        if min(self.stride) <= 0:
            raise self.fail(f"stride must be positive, got {self.stride}")
        if self.pad != (0, 0) and (self.pad[0] >= self.kernel[0] or self.pad[1] >= self.kernel[1]) \
                and not self.global_pooling:
            raise self.fail(f"pad {self.pad} must be smaller than the kernel {self.kernel}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (num, channels, height, width), "
                            f"got shape {shape}")
        n, c, h, w = shape
        kernel = (h, w) if self.global_pooling else self.kernel
        (kh, kw), (ph, pw), (sh, sw) = kernel, self.pad, self.stride
        any_pad = ph != 0 or pw != 0
        out_h = pool_out_size(h, kh, ph, sh, any_pad)
        out_w = pool_out_size(w, kw, pw, sw, any_pad)
        if out_h <= 0 or out_w <= 0:
            raise self.fail(f"kernel {kernel} is larger than the padded input {h}x{w}")
        self.geometry = Geometry(c, h, w, kh, kw, sh, sw, ph, pw, 1, 1, out_h, out_w)
        for t in top:
            t.reshape((n, c, out_h, out_w))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if self.method == _POOL.MAX:
            out, self.argmax = pool.max_pool_forward(x, self.geometry)
            if len(top) > 1:
                top[1].data[...] = pool.max_pool_mask(self.argmax, self.geometry)
        else:
            out = pool.ave_pool_forward(x, self.geometry)
        top[0].data[...] = out

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        dy = top[0].diff
        if self.method == _POOL.MAX:
            pool.max_pool_backward(dy, self.argmax, self.geometry, bottom[0].diff)
        else:
            pool.ave_pool_backward(dy, self.geometry, bottom[0].diff)


@register("SPP")
class SPPLayer(Layer):
    """Caffe's spatial pyramid pooling. Level i pools each plane into 2^i x 2^i bins with a
    Pooling layer (kernel ceil(size / 2^i), stride = kernel, pad (kernel·2^i - size + 1) / 2,
    all under Pooling's own rules); each level's output, flattened per item, is concatenated
    in level order into a (num, total) top. With pyramid_height 1 the top is the single
    level's (num, channels, 1, 1) output, as in Caffe."""

    exact_num_bottoms = 1
    exact_num_tops = 1

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.spp_param
        self.pyramid_height = int(p.pyramid_height)
        if self.pyramid_height < 1:
            raise self.fail(f"pyramid_height must be at least 1, got {self.pyramid_height}")
        self.method = {_SPP.MAX: _POOL.MAX, _SPP.AVE: _POOL.AVE,
                       _SPP.STOCHASTIC: _POOL.STOCHASTIC}[p.pool]
        self.levels: list[PoolingLayer] = []
        self.outputs: list[Blob] = []
        self.built_for: tuple[int, int] | None = None
        self.scratch: Blob | None = None  # one level's input gradient, before the sum

    def _pooling_param(self, level: int, height: int, width: int) -> Any:
        bins = 2 ** level
        lp = caffe_pb2.LayerParameter(name=f"{self.name}/level{level}", type="Pooling")
        pp = lp.pooling_param
        pp.pool = self.method
        for axis, size in (("h", height), ("w", width)):
            kernel = -(-size // bins)
            setattr(pp, f"kernel_{axis}", kernel)
            setattr(pp, f"stride_{axis}", kernel)
            # the padding the bins need beyond the image, split with the odd pixel first
            setattr(pp, f"pad_{axis}", (kernel * bins - size + 1) // 2)
        return lp

    def _build(self, bottom: Blob, height: int, width: int) -> None:
        """One Pooling layer per level, for planes of height x width."""
        xp = backend.get_array_module(bottom.data)
        self.levels, self.outputs = [], []
        for i in range(self.pyramid_height):
            level = PoolingLayer(self._pooling_param(i, height, width), self.phase)
            level.context = self.context
            out = Blob((), dtype=bottom.dtype, xp=xp, name=f"{self.name}/level{i}")
            try:
                level.check_blob_counts([bottom], [out])
                level.setup([bottom], [out])
                level.reshape([bottom], [out])
            except LayerError as e:
                raise self.fail(f"pyramid level {i} ({2 ** i}x{2 ** i} bins) cannot pool a "
                                f"{height}x{width} input: {e}") from None
            self.levels.append(level)
            self.outputs.append(out)
        self.built_for = (height, width)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != 4:
            raise self.fail(f"input must have 4 axes (num, channels, height, width), "
                            f"got shape {shape}")
        n, _, height, width = shape
        if height <= 0 or width <= 0:
            raise self.fail(f"input dimensions cannot be zero, got shape {shape}")
        if self.built_for != (height, width):
            self._build(bottom[0], height, width)
        else:
            for level, out in zip(self.levels, self.outputs):
                level.reshape(bottom, [out])
        if self.pyramid_height == 1:
            top[0].reshape(self.outputs[0].shape)
        else:
            top[0].reshape((n, sum(out.count_range(1) for out in self.outputs)))
            if self.scratch is None:
                self.scratch = Blob(shape, dtype=bottom[0].dtype,
                                    xp=backend.get_array_module(bottom[0].data))
            self.scratch.reshape(shape)

    def _segments(self, a: Any) -> list[Any]:
        """Views of the top array (num, total) holding each level's flattened output."""
        flat = a.reshape(a.shape[0], -1)
        bounds = [0]
        for out in self.outputs:
            bounds.append(bounds[-1] + out.count_range(1))
        return [flat[:, lo:hi] for lo, hi in zip(bounds, bounds[1:])]

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for level, out, seg in zip(self.levels, self.outputs, self._segments(top[0].data)):
            level.forward(bottom, [out])
            seg[...] = out.data.reshape(seg.shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        segments = self._segments(top[0].diff)
        for i, (level, out, seg) in enumerate(zip(self.levels, self.outputs, segments)):
            out.diff[...] = seg.reshape(out.shape)
            # the first level writes the bottom's gradient, the others add to it: the
            # bottom feeds every level, as through Caffe's internal Split
            target = bottom[0] if i == 0 else self.scratch
            level.backward([out], [True], [target])
            if i:
                bottom[0].diff += self.scratch.diff
