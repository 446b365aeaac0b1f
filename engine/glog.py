"""Caffe/glog-style log lines: ``I1121 11:21:25.363759 12345 solver.py:239] message``.

Caffe's tools (tools/extra/parse_log.py, plot_training_log.py) read training logs by this
prefix and by the exact wording of the solver's lines, so Poseidon writes the same lines.
Everything goes to one stream (stderr by default, as glog does with logtostderr); while a
rich progress bar is live, lines are routed through its console so the bar stays intact.
"""
from __future__ import annotations

import datetime as _dt
import os
import sys
import threading
from typing import Any, Callable, TextIO

_lock = threading.Lock()
_stream: TextIO | None = None          # None = the current sys.stderr
_printer: Callable[[str], None] | None = None  # set while a progress bar owns the terminal
_enabled = True


def set_stream(stream: TextIO | None) -> None:
    """Send log lines to ``stream`` (None: back to sys.stderr)."""
    global _stream
    _stream = stream


def set_enabled(enabled: bool) -> None:
    """Non-root ranks of a distributed run stay quiet (only rank 0 logs, as in Caffe)."""
    global _enabled
    _enabled = enabled


def set_printer(printer: Callable[[str], None] | None) -> None:
    """Route lines through ``printer`` (a progress bar's console) instead of the stream."""
    global _printer
    _printer = printer


def prefix(severity: str = "I", depth: int = 1) -> str:
    """glog's classic prefix for the caller ``depth`` frames up: ``Immdd hh:mm:ss.uuuuuu tid file:line] ``."""
    frame = sys._getframe(depth + 1)
    now = _dt.datetime.now()
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return (f"{severity}{now:%m%d %H:%M:%S}.{now.microsecond:06d} "
            f"{threading.get_native_id()} {where}] ")


def _emit(severity: str, message: str) -> None:
    if not _enabled:
        return
    head = prefix(severity, depth=2)
    # A multi-line message (a printed proto) keeps glog's shape: prefix on the first line only.
    line = head + message
    with _lock:
        if _printer is not None:
            _printer(line)
        else:
            stream = _stream or sys.stderr
            stream.write(line + "\n")
            stream.flush()


def info(message: str) -> None:
    _emit("I", message)


def warning(message: str) -> None:
    _emit("W", message)


def error(message: str) -> None:
    _emit("E", message)


def fmt(value: Any) -> str:
    """A number as C++'s ostream prints it by default (6 significant digits, like %g)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "%g" % float(value)
