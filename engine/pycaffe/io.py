"""``caffe.io``: BlobProto/Datum <-> arrays, image loading and resizing, and ``Transformer``.

The converters sit on the engine's (engine/caffe_io, engine/data/datum) with pycaffe's
conventions: a BlobProto's legacy num/channels/height/width win over ``shape``, a Datum built
without a label carries none, float arrays are stored as float ``data``. Images load with Pillow
as float32 in [0, 1], H x W x K, RGB (pycaffe's skimage convention, unlike Caffe's C++ BGR).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from engine.caffe_io import array_to_blob, blob_to_array
from engine.data import datum as _datum
from engine.pb import caffe_pb2


# -- proto / datum / ndarray ------------------------------------------------------------------
def blobproto_to_array(blob: Any, return_diff: bool = False) -> np.ndarray:
    """A BlobProto's data (or diff) as an array of its legacy 4-D shape, else of ``shape``; a
    ValueError when the values do not fill the shape."""
    return blob_to_array(blob, diff=return_diff, where="BlobProto")


def array_to_blobproto(arr: np.ndarray, diff: np.ndarray | None = None) -> Any:
    """A BlobProto with ``shape`` and float data (and diff when given)."""
    return array_to_blob(np.asarray(arr, dtype=np.float32),
                         None if diff is None else np.asarray(diff, dtype=np.float32))


def arraylist_to_blobprotovector_str(arraylist: Iterable[np.ndarray]) -> bytes:
    """A serialized BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend(array_to_blobproto(a) for a in arraylist)
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(data: bytes) -> list[np.ndarray]:
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(data)
    return [blobproto_to_array(b) for b in vec.blobs]


def array_to_datum(arr: np.ndarray, label: int | None = None) -> Any:
    """A Datum of a C x H x W array: uint8 as bytes, anything else as float_data."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError(f"Incorrect array shape: a Datum holds C x H x W, got {arr.shape}")
    datum = _datum.array_to_datum(arr if arr.dtype == np.uint8 else arr.astype(np.float32),
                                  label or 0)
    if label is None:
        datum.ClearField("label")
    return datum


def datum_to_array(datum: Any) -> np.ndarray:
    """A Datum's pixels as C x H x W (the label is ``datum.label``); encoded images decode."""
    return _datum.datum_to_array(datum)


# -- images -------------------------------------------------------------------------------------
def load_image(filename: str | Path, color: bool = True) -> np.ndarray:
    """An image file as float32 in [0, 1]: H x W x 3 RGB, or H x W x 1 with ``color=False``."""
    from PIL import Image

    with Image.open(filename) as img:
        img = img.convert("RGB" if color else "L")
        arr = np.asarray(img, dtype=np.float32) / np.float32(255)
    return arr if color else arr[:, :, None]


def resize_image(im: np.ndarray, new_dims: Sequence[int], interp_order: int = 1) -> np.ndarray:
    """Resize an H x W x K array to ``new_dims`` (height, width): interp_order 1 is bilinear
    (half-pixel centres), 0 nearest; float32 out."""
    h, w = int(new_dims[0]), int(new_dims[1])
    im = np.asarray(im)
    if interp_order == 1:
        out = _datum.bilinear(im, h, w)
    elif interp_order == 0:
        rows = np.minimum(((np.arange(h) + 0.5) * im.shape[0] / h).astype(int), im.shape[0] - 1)
        cols = np.minimum(((np.arange(w) + 0.5) * im.shape[1] / w).astype(int), im.shape[1] - 1)
        out = im[rows][:, cols]
    else:
        raise ValueError(f"interp_order must be 0 (nearest) or 1 (linear), got {interp_order}")
    return out.astype(np.float32)


def oversample(images: Sequence[np.ndarray], crop_dims: Sequence[int]) -> np.ndarray:
    """The four corner crops and the centre crop of each image, then the same five mirrored:
    10 * N x h x w x K."""
    ch, cw = int(crop_dims[0]), int(crop_dims[1])
    out = []
    for im in images:
        H, W = im.shape[:2]
        corners = [(0, 0), (0, W - cw), (H - ch, 0), (H - ch, W - cw),
                   (int(H / 2.0 - ch / 2.0), int(W / 2.0 - cw / 2.0))]
        crops = [im[y:y + ch, x:x + cw] for y, x in corners]
        out += crops + [c[:, ::-1] for c in crops]
    return np.asarray(out, dtype=np.float32)


# -- preprocessing ------------------------------------------------------------------------------
class Transformer:
    """Turns H x W x K images into a net's input (K x H x W) and back: resize, transpose,
    channel swap, raw scale, mean subtraction, input scale, in that order."""

    def __init__(self, inputs: Mapping[str, Sequence[int]]):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose: dict[str, Sequence[int]] = {}
        self.channel_swap: dict[str, Sequence[int]] = {}
        self.raw_scale: dict[str, float] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.input_scale: dict[str, float] = {}

    def _check(self, in_: str) -> tuple[int, ...]:
        if in_ not in self.inputs:
            raise Exception(f"{in_} is not one of the net inputs: {list(self.inputs)}")
        return self.inputs[in_]

    def preprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """(H' x W' x K) image -> (K x H x W) float32 input for blob ``in_``."""
        shape = self._check(in_)
        x = np.asarray(data, dtype=np.float32)
        if x.shape[:2] != shape[2:]:
            x = resize_image(x, shape[2:])
        if in_ in self.transpose:
            x = x.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            x = x[list(self.channel_swap[in_])]
        x = np.array(x, dtype=np.float32)  # a copy: the steps below write in place
        if in_ in self.raw_scale:
            x *= self.raw_scale[in_]
        if in_ in self.mean:
            x -= self.mean[in_]
        if in_ in self.input_scale:
            x *= self.input_scale[in_]
        return x

    def deprocess(self, in_: str, data: np.ndarray) -> np.ndarray:
        """Undo ``preprocess`` (except the resize)."""
        self._check(in_)
        x = np.array(data, dtype=np.float32).squeeze()
        if in_ in self.input_scale:
            x /= self.input_scale[in_]
        if in_ in self.mean:
            x += self.mean[in_]
        if in_ in self.raw_scale:
            x /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            x = x[np.argsort(self.channel_swap[in_])]
        if in_ in self.transpose:
            x = x.transpose(np.argsort(self.transpose[in_]))
        return x

    def set_transpose(self, in_: str, order: Sequence[int]) -> None:
        """Axis order, e.g. (2, 0, 1) for H x W x K images -> K x H x W."""
        if len(order) != len(self._check(in_)) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions as "
                            "the input.")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_: str, order: Sequence[int]) -> None:
        """Channel order after the transpose, e.g. (2, 1, 0) for RGB -> BGR."""
        if len(order) != self._check(in_)[1]:
            raise Exception("Channel swap needs to have the same number of dimensions as the "
                            "input channels.")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_: str, scale: float) -> None:
        """Multiply raw [0, 1] images by ``scale`` (255 for models trained on 0..255 pixels)."""
        self._check(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_: str, mean: np.ndarray) -> None:
        """Subtract ``mean``: per channel (K,), or an image (K x H x W, resized to the input)."""
        shape = self._check(in_)
        mean = np.asarray(mean, dtype=np.float32)
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, None, None]
        else:
            if mean.ndim == 2:
                mean = mean[None]
            if mean.ndim != 3:
                raise ValueError("Mean shape invalid")
            if mean.shape != shape[1:]:
                mean = resize_image(mean.transpose(1, 2, 0), shape[2:]).transpose(2, 0, 1)
        self.mean[in_] = mean

    def set_input_scale(self, in_: str, scale: float) -> None:
        """Multiply the preprocessed input by ``scale`` (after the mean)."""
        self._check(in_)
        self.input_scale[in_] = scale
