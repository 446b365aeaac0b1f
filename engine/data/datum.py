"""Datum <-> NumPy, and image decoding the way Caffe's OpenCV calls do it.

A Caffe ``Datum`` holds one image as ``channels x height x width`` uint8 bytes (CHW), or as
``float_data``, or, when ``encoded`` is set, as the bytes of a PNG/JPEG file. Caffe decodes
with OpenCV, which yields **BGR** channel order for colour images; we decode with Pillow and
swap to BGR so that an encoded record and the raw record Caffe's tools would have written
for the same picture give the same array.
"""
from __future__ import annotations

import functools
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


#: Pillow modes that OpenCV's IMREAD_ANYCOLOR would decode to one grey channel
_GREY_MODES = frozenset({"L", "1", "I", "I;16", "F", "LA"})
#: JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic)
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _jpeg_frame(buf: "bytes | memoryview") -> tuple[int, int, int] | None:
    """(height, width, components) from the frame header of an 8-bit JPEG, or None when the
    bytes are not one or are unusual (Pillow's own parser then judges them)."""
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
        elif marker in (0xD9, 0xDA):  # end of image or start of scan before any frame
            return None
        elif marker in _SOF:
            if i + 10 > n or buf[i + 4] != 8:
                return None
            height = (buf[i + 5] << 8) | buf[i + 6]
            width = (buf[i + 7] << 8) | buf[i + 8]
            return (height, width, buf[i + 9]) if height and width else None
        else:
            i += 2 + ((buf[i + 2] << 8) | buf[i + 3])
    return None


def _jpeg_pixels(buf: "bytes | memoryview", color: bool | None) -> np.ndarray | None:
    """The HWC pixels of a plain JPEG (8-bit, 3 components decoded to colour or 1 to grey),
    decoded by Pillow's JPEG decoder straight into NumPy memory; None for anything else.

    Pillow's own route (Image.open, then np.asarray) parses the markers in Python and copies
    the pixels out of the image with the GIL held (tobytes alone: 220 us against 720 us of
    decoding for a 256x256 JPEG on the 2-core VM), which kept decoding threads from scaling
    (2 threads did not beat one). Here the frame header is
    read by ``_jpeg_frame``, the image is a Pillow image mapped onto a NumPy array (RGBX:
    Pillow keeps RGB pixels in 4 bytes) and the decoder, given the arguments JpegImageFile
    gives it, writes into it with the GIL released; BGR is a view of that array.
    """
    frame = _jpeg_frame(buf)
    if frame is None:
        return None
    height, width, components = frame
    if components == 3 and color is not False:
        pixels, mode, rawmode = np.empty((height, width, 4), dtype=np.uint8), "RGBX", "RGB"
    elif components == 1 and not color:
        pixels, mode, rawmode = np.empty((height, width), dtype=np.uint8), "L", "L"
    else:
        return None
    Image = _pil()
    Image.frombuffer(mode, (width, height), pixels, "raw", mode, 0, 1).frombytes(
        buf, "jpeg", rawmode, "")
    return pixels[:, :, 2::-1] if components == 3 else pixels[:, :, None]


@functools.cache
def _direct_jpeg_works() -> bool:
    """Whether ``_jpeg_pixels`` gives what Image.open does, checked once per process on two
    small JPEGs (colour and grey): it relies on Pillow decoding into a mapped buffer."""
    Image = _pil()
    rng = np.random.default_rng(0)
    for shape, mode in (((12, 10, 3), "RGB"), ((12, 10), "L")):
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode).save(
            out, format="JPEG")
        img = Image.open(io.BytesIO(out.getvalue()))
        want = np.asarray(img).reshape(12, 10, -1)
        got = _jpeg_pixels(out.getvalue(), None)
        if got is None or not np.array_equal(got[:, :, ::-1] if mode == "RGB" else got, want):
            return False
    return True


def decode_image(buf: "bytes | memoryview", color: bool | None = None) -> np.ndarray:
    """Decode PNG/JPEG bytes to an HWC uint8 array (BGR for colour, one channel for grey).

    ``color=None`` keeps the file's own kind (OpenCV's IMREAD_ANYCOLOR, Caffe's
    DecodeDatumToCVMatNative); True forces 3 channels, False forces grey. The result may be
    a read-only or strided view (BGR is RGB read backwards): copy it to write to it.
    """
    Image = _pil()
    try:
        pixels = _jpeg_pixels(buf, color) if _direct_jpeg_works() else None
        if pixels is not None:
            return pixels
        img = Image.open(io.BytesIO(buf))
        img.load()
    except Image.UnidentifiedImageError:
        raise DataError(f"cannot decode image ({len(buf)} bytes): not in a format Pillow "
                        "reads (PNG, JPEG, BMP, ...)") from None
    except Exception as e:
        raise DataError(f"cannot decode image ({len(buf)} bytes): {e}") from None
    if color is None:
        # OpenCV decodes grey files to one channel and everything else (palette too) to BGR
        color = img.mode not in _GREY_MODES
    if color:
        rgb = np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
        return rgb[:, :, ::-1]  # OpenCV order
    return np.asarray(img if img.mode == "L" else img.convert("L"), dtype=np.uint8)[:, :, None]


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


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]  # IndexError past the end: the caller falls back to protobuf
        value |= (byte & 0x7F) << shift
        i += 1
        if byte < 0x80:
            return value, i
        shift += 7


#: Datum's varint fields by number (channels, height, width, label, encoded)
_DATUM_VARINTS = {1: 0, 2: 1, 3: 2, 5: 3, 7: 4}


def _scan_datum(value: bytes) -> tuple[list[int], int, int] | None:
    """The varint fields and the (offset, length) of ``data`` of a serialized Datum, read
    off the wire format without copying the pixels; None when the record holds anything
    else (float_data, unknown fields, a malformed buffer): protobuf then parses it."""
    fields = [0, 0, 0, 0, 0]
    start = length = -1
    i, n = 0, len(value)
    try:
        while i < n:
            tag, i = _varint(value, i)
            number, wire = tag >> 3, tag & 7
            if wire == 0 and number in _DATUM_VARINTS:
                fields[_DATUM_VARINTS[number]], i = _varint(value, i)
            elif wire == 2 and number == 4:
                length, i = _varint(value, i)
                start = i
                i += length
            else:
                return None
    except IndexError:
        return None
    if i != n or start < 0:
        return None
    label = fields[3] & 0xFFFFFFFF  # int32 on the wire: a negative one is sign-extended
    fields[3] = label - (1 << 32) if label >= 1 << 31 else label
    return fields, start, length


def datum_is_encoded(value: bytes) -> bool:
    """Whether a serialized Datum holds an encoded image (PNG, JPEG) rather than pixels."""
    scanned = _scan_datum(value)
    return bool(scanned[0][4]) if scanned is not None else parse_datum(value).encoded


def datum_image(value: bytes, color: bool | None = None) -> tuple[np.ndarray, int]:
    """The CHW pixels and the label of one serialized Datum, as ``datum_to_array`` gives them
    but without protobuf's two copies of the pixels: raw bytes come back as a read-only view
    of ``value``, an encoded image decoded straight from it."""
    scanned = _scan_datum(value)
    if scanned is None:
        datum = parse_datum(value)
        return datum_to_array(datum, color), datum.label
    (channels, height, width, label, encoded), start, length = scanned
    if encoded:
        pixels = decode_image(memoryview(value)[start:start + length], color)
        return pixels.transpose(2, 0, 1), label
    shape = (channels, height, width)
    if length != channels * height * width:
        raise DataError(f"datum of shape {shape} has {length} data bytes, "
                        f"expected {channels * height * width}")
    return np.frombuffer(value, dtype=np.uint8, count=length, offset=start).reshape(shape), label


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
