"""BlobProto <-> NumPy arrays, .binaryproto files (mean images) and Caffe's blob shape matching."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..pb import caffe_pb2
from .files import FormatError, PathLike, atomic_write_bytes, parse_binary, read_bytes


def _has_legacy_shape(blob: caffe_pb2.BlobProto) -> bool:
    return any(blob.HasField(f) for f in ("num", "channels", "height", "width"))


def blob_shape(blob: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """The blob's shape: `shape` if present, else the legacy (num, channels, height, width)."""
    if _has_legacy_shape(blob):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(int(d) for d in blob.shape.dim)


def blob_to_array(blob: caffe_pb2.BlobProto, diff: bool = False, where: str = "blob"
                  ) -> np.ndarray:
    """The blob's data (or diff) as an array of its shape: float32, or float64 for double_*."""
    shape = blob_shape(blob)
    doubles = blob.double_diff if diff else blob.double_data
    values = np.asarray(doubles, dtype=np.float64) if len(doubles) else \
        np.asarray(blob.diff if diff else blob.data, dtype=np.float32)
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise FormatError(f"{where}: {values.size} values for shape {shape} ({count} expected)")
    return values.reshape(shape)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packed(field_number: int, values: np.ndarray, dtype: str) -> bytes:
    """The wire bytes of a packed repeated float/double field: far faster than extend()."""
    payload = np.ascontiguousarray(values, dtype=dtype).tobytes()
    return _varint((field_number << 3) | 2) + _varint(len(payload)) + payload


#: float64? -> (data field number, diff field number, little-endian dtype)
_BLOB_FIELDS = {
    False: (caffe_pb2.BlobProto.DATA_FIELD_NUMBER, caffe_pb2.BlobProto.DIFF_FIELD_NUMBER, "<f4"),
    True: (caffe_pb2.BlobProto.DOUBLE_DATA_FIELD_NUMBER,
           caffe_pb2.BlobProto.DOUBLE_DIFF_FIELD_NUMBER, "<f8"),
}


def array_to_blob(data: Any, diff: Any = None) -> caffe_pb2.BlobProto:
    """A BlobProto with `shape`; float64 arrays go to double_data/double_diff as Caffe's
    Blob<double> writes them, everything else to float data/diff."""
    from ..backend import to_numpy

    data = to_numpy(data)
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(int(d) for d in data.shape)
    double = data.dtype == np.float64
    fields = _BLOB_FIELDS[double]
    wire = _packed(fields[0], data.ravel(), fields[2])
    if diff is not None:
        wire += _packed(fields[1], to_numpy(diff).ravel(), fields[2])
    blob.MergeFromString(wire)
    return blob


def shape_matches(target_shape: Sequence[int], blob: caffe_pb2.BlobProto) -> bool:
    """Caffe's Blob::ShapeEquals: a legacy 4-D blob matches a target of <= 4 axes whose shape,
    left-padded with 1s to 4 axes, equals (num, channels, height, width)."""
    target = tuple(int(d) for d in target_shape)
    if _has_legacy_shape(blob):
        return len(target) <= 4 and (1,) * (4 - len(target)) + target == blob_shape(blob)
    return target == blob_shape(blob)


def read_blobproto(path: PathLike) -> np.ndarray:
    """A .binaryproto file (e.g. a mean image) as an array of its stored shape."""
    blob = caffe_pb2.BlobProto()
    parse_binary(read_bytes(path), blob, path, "binaryproto")
    return blob_to_array(blob, where=str(path))


def write_blobproto(path: PathLike, array: Any) -> None:
    atomic_write_bytes(path, array_to_blob(array).SerializeToString())
