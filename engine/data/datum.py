"""Datum <-> NumPy, and image decoding the way Caffe's OpenCV calls do it.

A Caffe ``Datum`` holds one image as ``channels x height x width`` uint8 bytes (CHW), or as
``float_data``, or, when ``encoded`` is set, as the bytes of a PNG/JPEG file. Caffe decodes
with OpenCV, which yields **BGR** channel order for colour images; we decode with Pillow and
swap to BGR so that an encoded record and the raw record Caffe's tools would have written
for the same picture give the same array.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from ..pb import caffe_pb2


class DataError(ValueError):
    """Bad data: a missing or corrupt database, image, list or mean file (message says which)."""


def _pil():
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        raise DataError("decoding PNG/JPEG needs Pillow (pip install pillow)") from None
    return Image


def decode_image(buf: bytes, color: bool | None = None) -> np.ndarray:
    """Decode PNG/JPEG bytes to an HWC uint8 array (BGR for colour, one channel for grey).

    ``color=None`` keeps the file's own kind (OpenCV's IMREAD_ANYCOLOR, Caffe's
    DecodeDatumToCVMatNative); True forces 3 channels, False forces grey.
    """
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(buf))
        img.load()
    except Image.UnidentifiedImageError:
        raise DataError(f"cannot decode image ({len(buf)} bytes): not in a format Pillow "
                        "reads (PNG, JPEG, BMP, ...)") from None
    except Exception as e:
        raise DataError(f"cannot decode image ({len(buf)} bytes): {e}") from None
    if color is None:
        # OpenCV decodes grey files to one channel and everything else (palette too) to BGR
        color = img.mode not in ("L", "1", "I", "I;16", "F", "LA")
    if color:
        rgb = np.asarray(img.convert("RGB"), dtype=np.uint8)
        return np.ascontiguousarray(rgb[:, :, ::-1])  # OpenCV order
    return np.asarray(img.convert("L"), dtype=np.uint8)[:, :, None]


def encode_image(chw: np.ndarray, fmt: str = "PNG") -> bytes:
    """Encode a CHW uint8 array (BGR if 3 channels, as Caffe stores them) as PNG/JPEG bytes."""
    Image = _pil()
    c = chw.shape[0]
    if c == 1:
        img = Image.fromarray(np.ascontiguousarray(chw[0]), mode="L")
    elif c == 3:
        img = Image.fromarray(np.ascontiguousarray(chw[::-1].transpose(1, 2, 0)), mode="RGB")
    else:
        raise DataError(f"can only encode 1- or 3-channel images, got {c} channels")
    out = io.BytesIO()
    img.save(out, format=fmt)
    return out.getvalue()


def bilinear(hwc: np.ndarray, height: int, width: int) -> np.ndarray:
    """OpenCV's INTER_LINEAR geometry (half-pixel centres, edge clamp, no antialiasing) on an
    H x W x K array of any dtype; the result is float64, unrounded."""
    h, w = hwc.shape[:2]

    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
        src = np.clip(src, 0, n_in - 1)
        lo = np.floor(src).astype(np.int64)
        hi = np.minimum(lo + 1, n_in - 1)
        return lo, hi, (src - lo)[:, None]

    y0, y1, fy = axis(h, height)
    x0, x1, fx = axis(w, width)
    img = hwc.astype(np.float64)
    rows = img[y0] * (1 - fy[:, :, None]) + img[y1] * fy[:, :, None]
    return rows[:, x0] * (1 - fx[None]) + rows[:, x1] * fx[None]


def resize_bilinear(hwc: np.ndarray, height: int, width: int) -> np.ndarray:
    """OpenCV's INTER_LINEAR resize of a uint8 H x W x K image.

    Pillow's bilinear filter widens its kernel when shrinking, so it would not give the
    pictures Caffe's ImageData layer sees; this follows cv::resize instead (to within one
    grey level: OpenCV rounds its weights to 11 bits).
    """
    if hwc.shape[:2] == (height, width):
        return hwc
    # OpenCV's fixed-point arithmetic rounds halves up
    return np.clip(np.floor(bilinear(hwc, height, width) + 0.5), 0, 255).astype(np.uint8)


def load_image(path: Path, is_color: bool = True, new_height: int = 0,
               new_width: int = 0) -> np.ndarray:
    """Caffe's ReadImageToCVMat: a CHW uint8 array (3 channels BGR, or 1 grey), resized if asked."""
    try:
        buf = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"cannot read image {path}: {e.strerror}") from None
    try:
        hwc = decode_image(buf, color=is_color)
    except DataError as e:
        raise DataError(f"{path}: {e}") from None
    if new_height > 0 and new_width > 0:
        hwc = resize_bilinear(hwc, new_height, new_width)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


def datum_to_array(datum: "caffe_pb2.Datum", color: bool | None = None) -> np.ndarray:
    """The datum's pixels as CHW: uint8 for byte data and encoded images, float32 for float_data.

    ``color`` applies to encoded data only (TransformationParameter force_color/force_gray).
    """
    if datum.encoded:
        return np.ascontiguousarray(decode_image(datum.data, color).transpose(2, 0, 1))
    shape = (datum.channels, datum.height, datum.width)
    n = shape[0] * shape[1] * shape[2]
    if datum.data:
        if len(datum.data) != n:
            raise DataError(f"datum of shape {shape} has {len(datum.data)} data bytes, "
                            f"expected {n}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    if len(datum.float_data) != n or n == 0:
        raise DataError(f"datum of shape {shape} has {len(datum.float_data)} float values, "
                        f"expected {n}")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(shape)


def parse_datum(value: bytes) -> "caffe_pb2.Datum":
    """Deserialize one record; a DataError (not a protobuf exception) when it is not a Datum."""
    datum = caffe_pb2.Datum()
    try:
        datum.ParseFromString(value)
    except Exception as e:
        raise DataError(f"not a serialized Datum ({len(value)} bytes): {e}") from None
    return datum


def array_to_datum(chw: np.ndarray, label: int = 0, encode: str | None = None) -> "caffe_pb2.Datum":
    """A Datum from a CHW array: uint8 -> data bytes (PNG/JPEG when ``encode`` names a format),
    floating point -> float_data."""
    chw = np.asarray(chw)
    if chw.ndim != 3:
        raise DataError(f"a datum holds a CHW array, got shape {chw.shape}")
    c, h, w = chw.shape
    datum = caffe_pb2.Datum(channels=c, height=h, width=w, label=int(label))
    if chw.dtype == np.uint8:
        if encode:
            datum.data = encode_image(chw, encode)
            datum.encoded = True
        else:
            datum.data = np.ascontiguousarray(chw).tobytes()
    elif np.issubdtype(chw.dtype, np.floating):
        datum.float_data.extend(chw.astype(np.float32).ravel().tolist())
    else:
        raise DataError(f"a datum holds uint8 or float pixels, got {chw.dtype}")
    return datum
