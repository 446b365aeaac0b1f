"""Caffe's DataTransformer: crop, mirror, mean subtraction and scaling of input images.

For every output element, in this order (data_transformer.cpp):

    out[c, h, w'] = (pixel[c, h_off + h, w_off + w] - mean) * scale,   w' = W-1-w if mirrored

where ``mean`` is the mean file's value at the *uncropped* position (the mean image is as big
as the input and is cut with the same crop offset) or ``mean_value[c]``; the arithmetic is
float32 as in Caffe. The crop is random in TRAIN and centred ((H - crop) // 2) in TEST;
mirroring is a coin flip when ``mirror`` is set, in either phase.

Randomness comes from three 64-bit words per image (``crop_draws``), a hash of the layer's
seed and the image's stream index, so that crops do not depend on threads, workers or
restarts; the words of a whole batch are one vectorised NumPy call (a Generator per image
cost some 90 us of Python with the GIL held, as much as a tenth of a JPEG's decoding).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import caffe_io
from ..pb import caffe_pb2
from .datum import DataError


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea and Flood 2014) on uint64, wrapping."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def crop_draws(seed: int, indices: np.ndarray) -> np.ndarray:
    """(N, 3) uint64 random words for the images at stream ``indices``: the mirror, the crop's
    row and its column; a pure function of (seed, index)."""
    with np.errstate(over="ignore"):
        base = _splitmix64(np.uint64(seed) ^ _splitmix64(np.asarray(indices, dtype=np.uint64)))
        return np.stack([_splitmix64(base + np.uint64(j)) for j in (1, 2, 3)], axis=1)


def _below(word: int, n: int) -> int:
    """A draw in [0, n) from a 64-bit word: its high half scaled (bias below n / 2**32)."""
    return ((word >> 32) * n) >> 32


def read_mean_file(path: Path) -> np.ndarray:
    """A mean .binaryproto (BlobProto, 1 x C x H x W) as a float32 (C, H, W) array."""
    try:
        mean = caffe_io.read_blobproto(path)
    except caffe_io.FormatError as e:
        raise DataError(f"mean file: {e}") from None
    shape = mean.shape[1:] if mean.ndim == 4 and mean.shape[0] == 1 else mean.shape
    if len(shape) != 3 or mean.size == 0:
        raise DataError(f"mean file {path}: expected a 1 x C x H x W blob, got shape {mean.shape}")
    return mean.astype(np.float32).reshape(shape)


def write_mean_file(path: Path, mean: np.ndarray) -> None:
    """Write a (C, H, W) mean as compute_image_mean does (legacy num/channels/height/width)."""
    c, h, w = mean.shape
    blob = caffe_pb2.BlobProto(num=1, channels=c, height=h, width=w)
    blob.data.extend(np.asarray(mean, dtype=np.float32).ravel().tolist())
    caffe_io.atomic_write_bytes(path, blob.SerializeToString())


class DataTransformer:
    """Applies one TransformationParameter; ``where`` names the layer in error messages."""

    def __init__(self, param: "caffe_pb2.TransformationParameter", phase: str,
                 mean_path: Path | None = None, where: str = "data"):
        self.phase = phase
        self.where = where
        self.scale = np.float32(param.scale)
        self.mirror = bool(param.mirror)
        self.crop_size = int(param.crop_size)
        if param.force_color and param.force_gray:
            raise DataError(f"{where}: cannot set both force_color and force_gray")
        #: colour mode for decoding encoded images (None = as stored)
        self.color: bool | None = True if param.force_color else False if param.force_gray else None
        if param.HasField("mean_file") and len(param.mean_value):
            raise DataError(f"{where}: cannot specify mean_file and mean_value at the same time")
        self.mean_path = mean_path
        self.mean: np.ndarray | None = read_mean_file(mean_path) if mean_path is not None else None
        self.mean_values = np.asarray(param.mean_value, dtype=np.float32)

    @property
    def random(self) -> bool:
        """True when the output depends on a random draw (random crop or mirror)."""
        return self.mirror or (self.crop_size > 0 and self.phase == "TRAIN")

    def output_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """Caffe's InferBlobShape for one CHW input; checks the input against the parameters."""
        c, h, w = shape
        if self.crop_size and (h < self.crop_size or w < self.crop_size):
            raise DataError(f"{self.where}: crop_size {self.crop_size} is larger than the "
                            f"{h}x{w} input")
        if self.mean is not None and self.mean.shape != tuple(shape):
            raise DataError(f"{self.where}: mean file {self.mean_path} has shape "
                            f"{self.mean.shape} but the data is {tuple(shape)}")
        if len(self.mean_values) not in (0, 1, c):
            raise DataError(f"{self.where}: specify either 1 mean_value or as many as channels "
                            f"({c}), got {len(self.mean_values)}")
        if self.crop_size:
            return c, self.crop_size, self.crop_size
        return c, h, w

    def transform(self, images: np.ndarray, draws: np.ndarray | None = None) -> np.ndarray:
        """Transform a batch (N, C, H, W) of uint8 or float32 images; float32 (N, C, h, w) out.

        ``draws`` (``crop_draws``, a row per image) is required when ``self.random``.
        """
        n, c, h, w = images.shape
        out = np.empty((n, *self.output_shape((c, h, w))), dtype=np.float32)
        if self.random and (draws is None or len(draws) != n):
            raise ValueError("a random transform needs a row of crop_draws per image")
        for i in range(n):
            self.transform_into(images[i], out[i],
                                tuple(int(v) for v in draws[i]) if self.random else None)
        return out

    def transform_into(self, image: np.ndarray, out: np.ndarray,
                       draw: tuple[int, int, int] | None = None) -> None:
        """Transform one (C, H, W) image (any strides: a view of a record is fine) into
        ``out``, float32 of ``output_shape(image.shape)``, in one pass over the output.

        Each element is Caffe's ``(pixel - mean) * scale`` in float32, the crop and the
        mirror taken from the input by indexing (nothing is copied before the arithmetic).
        Elementwise the same operations as on the whole uncropped image, so the same bits.
        ``draw``: the image's row of ``crop_draws`` (mirror, crop row, crop column).
        """
        _, h, w = image.shape
        _, oh, ow = out.shape
        flip = self.mirror and bool(draw[0] >> 63) if self.random else False
        if self.crop_size and self.phase == "TRAIN":
            h0, w0 = _below(draw[1], h - oh + 1), _below(draw[2], w - ow + 1)
        else:
            h0, w0 = (h - oh) // 2, (w - ow) // 2
        cols = slice(w0 + ow - 1, w0 - 1 if w0 else None, -1) if flip else slice(w0, w0 + ow)
        src = image[:, h0:h0 + oh, cols]
        if self.mean is not None:
            np.subtract(src, self.mean[:, h0:h0 + oh, cols], out=out, dtype=np.float32)
        elif len(self.mean_values):
            np.subtract(src, self.mean_values.reshape(-1, 1, 1), out=out, dtype=np.float32)
        else:
            out[...] = src
        if self.scale != 1:  # x * 1 is x: skip the pass
            out *= self.scale
