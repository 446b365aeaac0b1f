"""Which kind of Caffe file a file is, told from its content: for the one-line error when a
file is given where another kind belongs (a .solverstate as weights, a solver as a net),
instead of the parse error its bytes give as the kind expected.

The readers ask only once their own parse has failed (or, for a solverstate, found nothing),
so a good file costs nothing more.
"""
from __future__ import annotations

from pathlib import Path

from google.protobuf import message as pb_message
from google.protobuf import text_format

from ..pb import caffe_pb2
from .files import HDF5_MAGIC, FormatError, PathLike, import_h5py

#: each kind, as an error names it
NAMES = {"net": "a net prototxt", "solver": "a solver prototxt",
         "caffemodel": "a caffemodel (weights)", "solverstate": "a solverstate (a snapshot of "
         "the solver's state)", "binaryproto": "a blob (.binaryproto, such as a mean image)"}


class WrongFileKind(FormatError):
    """A good file of another kind than the one expected; ``kind`` is a key of NAMES."""

    def __init__(self, path: PathLike, kind: str, expected: str) -> None:
        super().__init__(f"{path} is {NAMES[kind]}, not {NAMES[expected]}")
        self.kind = kind


def kind_of(path: PathLike) -> str | None:
    """The kind of Caffe file at ``path`` (a key of NAMES), or None: none, or unreadable."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if data.startswith(HDF5_MAGIC):
        return _hdf5_kind(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return _binary_kind(data)
    for kind, message in (("net", caffe_pb2.NetParameter()),
                          ("solver", caffe_pb2.SolverParameter())):
        try:
            text_format.Parse(text, message)
        except text_format.ParseError:
            continue
        if message.ByteSize():
            return kind
    return _binary_kind(data)  # a binary file can be valid UTF-8 (a tiny solverstate)


def _binary_kind(data: bytes) -> str | None:
    # Protobuf parses one message as another (fields of other numbers or wire types are kept
    # as unknown), so each kind is asked for what it must hold, in an order where no earlier
    # kind's fields read as a later one's: a net its layers, a state its learned net or
    # history, a blob its values.
    for kind, message, holds in (
            ("caffemodel", caffe_pb2.NetParameter(), lambda m: len(m.layer) or len(m.layers)),
            ("solverstate", caffe_pb2.SolverState(), lambda m: m.learned_net or len(m.history)),
            ("binaryproto", caffe_pb2.BlobProto(), lambda m: len(m.data) or len(m.double_data))):
        try:
            message.ParseFromString(data)
        except (pb_message.DecodeError, RuntimeError, ValueError):
            continue
        if holds(message):
            return kind
    return None


def _hdf5_kind(path: PathLike) -> str | None:
    try:
        with import_h5py().File(path, "r") as f:
            keys = set(f.keys())
    except OSError:
        return None
    if "data" in keys:
        return "caffemodel"
    if {"iter", "history"} & keys:
        return "solverstate"
    return None


def check_kind(path: PathLike, expected: str) -> None:
    """Raise WrongFileKind when ``path`` is a good file of another kind than ``expected``."""
    kind = kind_of(path)
    if kind is not None and kind != expected:
        raise WrongFileKind(path, kind, expected)
