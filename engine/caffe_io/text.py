"""Prototxt (protobuf text format) nets and solvers: read, parse and write.

A syntax or value error becomes one `FormatError` line ``file:line:col: field 'x': ...``
instead of protobuf's traceback; nets and solvers are upgraded to the current dialect as Caffe
does when it reads them.
"""
from __future__ import annotations

import re

from google.protobuf import message as pb_message
from google.protobuf import text_format

from ..pb import caffe_pb2
from .files import FormatError, PathLike, atomic_write_bytes, read_bytes
from .kinds import check_kind
from .upgrade import upgrade_net, upgrade_solver

_LOCATION_PREFIX = re.compile(r"^\d+:\d+\s*:\s*")
_QUOTED_LINE_PREFIX = re.compile(r"^'.*?':\s*")
_FIELD_BEFORE_VALUE = re.compile(r"([A-Za-z_]\w*)\s*:?\s*$")
_STRUCTURAL = re.compile(r'^Expected "[{}:<>]"')


def _parse_error_message(err: text_format.ParseError, text: str, filename: str) -> str:
    line, col = err.GetLine(), err.GetColumn()
    msg = _QUOTED_LINE_PREFIX.sub("", _LOCATION_PREFIX.sub("", str(err)), count=1).strip()
    if line is None:
        return f"{filename}: {msg}"
    lines = text.splitlines()
    # Value errors point at the value; the identifier just before it is the offending field.
    if "field named" not in msg and not _STRUCTURAL.match(msg) and 0 < line <= len(lines):
        m = _FIELD_BEFORE_VALUE.search(lines[line - 1][: max(col - 1, 0)])
        if m:
            msg = f"field '{m.group(1)}': {msg}"
    return f"{filename}:{line}:{col}: {msg}"


def _parse_text(text: str, msg: pb_message.Message, filename: str) -> None:
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        raise FormatError(_parse_error_message(e, text, filename)) from None


def _read_text(path: PathLike) -> str:
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not a text prototxt (byte {e.start} is not UTF-8)") from None


def parse_net_text(text: str, filename: str = "<string>", upgrade: bool = True
                   ) -> caffe_pb2.NetParameter:
    """A NetParameter from prototxt text, upgraded to the current dialect unless `upgrade=False`."""
    net = caffe_pb2.NetParameter()
    _parse_text(text, net, filename)
    if upgrade:
        upgrade_net(net, filename)
    return net


def read_net_prototxt(path: PathLike, upgrade: bool = True) -> caffe_pb2.NetParameter:
    try:
        return parse_net_text(_read_text(path), str(path), upgrade)
    except FormatError:
        check_kind(path, "net")  # a solver given as a net says so, not "no field 'base_lr'"
        raise


def parse_solver_text(text: str, filename: str = "<string>", upgrade: bool = True
                      ) -> caffe_pb2.SolverParameter:
    solver = caffe_pb2.SolverParameter()
    _parse_text(text, solver, filename)
    if upgrade:
        upgrade_solver(solver, filename)
    return solver


def read_solver_prototxt(path: PathLike, upgrade: bool = True) -> caffe_pb2.SolverParameter:
    try:
        return parse_solver_text(_read_text(path), str(path), upgrade)
    except FormatError:
        check_kind(path, "solver")
        raise


def write_prototxt(path: PathLike, msg: pb_message.Message) -> None:
    atomic_write_bytes(path, text_format.MessageToString(msg).encode("utf-8"))
