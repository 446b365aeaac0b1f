"""Caffe/glog-style log lines: ``I1121 11:21:25.363759 12345 solver.py:239] message``.

Caffe's tools (tools/extra/parse_log.py, plot_training_log.py) read training logs by this
prefix and by the exact wording of the solver's lines, so Poseidon writes the same lines.
Every module logs through stdlib ``logging`` (``logging.getLogger(__name__)``, or this module's
``info``/``warning``/``error``), and one handler on the ``engine`` and ``poseidon`` loggers
formats each record with ``GlogFormatter``. Everything goes to one stream (stderr by default,
as glog does with logtostderr); while a rich progress bar is live, lines are routed through
its console so the bar stays intact.
"""
from __future__ import annotations

import datetime as _dt
import logging
import sys
import threading
from typing import Any, Callable, TextIO

#: the loggers whose records become glog lines (modules log under these names)
ROOTS = ("engine", "poseidon")
_SEVERITY = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
             logging.CRITICAL: "F"}

_lock = threading.Lock()
_stream: TextIO | None = None          # None = the current sys.stderr
_printer: Callable[[str], None] | None = None  # set while a progress bar owns the terminal
_enabled = True
_log = logging.getLogger("engine.glog")


class GlogFormatter(logging.Formatter):
    """glog's classic prefix, ``Immdd hh:mm:ss.uuuuuu tid file:line] ``, then the message. A
    multi-line message (a printed proto) keeps glog's shape: prefix on the first line only."""

    def format(self, record: logging.LogRecord) -> str:
        t = _dt.datetime.fromtimestamp(record.created)
        severity = _SEVERITY.get(record.levelno, "I")
        # formatted on the emitting thread (handlers run synchronously): its native id is glog's
        return (f"{severity}{t:%m%d %H:%M:%S}.{t.microsecond:06d} {threading.get_native_id()} "
                f"{record.filename}:{record.lineno}] {record.getMessage()}")


class _GlogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if not _enabled and record.levelno < logging.WARNING:
            return
        line = self.format(record)
        with _lock:
            if _printer is not None:
                _printer(line)
            else:
                stream = _stream or sys.stderr
                stream.write(line + "\n")
                stream.flush()


#: glog's GLOG_minloglevel: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL
_MIN_LEVELS = {"0": logging.DEBUG, "1": logging.WARNING, "2": logging.ERROR,
               "3": logging.CRITICAL}


def min_level(environ: dict[str, str] | None = None) -> int:
    """The least severity printed: glog's GLOG_minloglevel (a pycaffe script sets it to 2 to
    keep every Net and Solver quiet), INFO when unset or not a level."""
    import os
    value = (os.environ if environ is None else environ).get("GLOG_minloglevel", "0").strip()
    return _MIN_LEVELS.get(value, logging.DEBUG)


def _install() -> None:
    handler = _GlogHandler()
    handler.setLevel(min_level())
    handler.setFormatter(GlogFormatter())
    for name in ROOTS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # one line per record, whatever the application configures


_install()


def set_stream(stream: TextIO | None) -> None:
    """Send log lines to ``stream`` (None: back to sys.stderr)."""
    global _stream
    _stream = stream


def set_enabled(enabled: bool) -> None:
    """Non-root ranks of a distributed run stay quiet (only rank 0 logs, as in Caffe), but
    for their warnings and errors."""
    global _enabled
    _enabled = enabled


class _FileHandler(logging.Handler):
    """Every record of this process to a file, whether or not the console is quiet."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered

    def emit(self, record: logging.LogRecord) -> None:
        self._file.write(self.format(record) + "\n")


def add_file(path: str) -> None:
    """Also write every log line, INFO and up, to ``path`` (appended): a rank's own log."""
    handler = _FileHandler(path)
    handler.setFormatter(GlogFormatter())
    for name in ROOTS:
        logging.getLogger(name).addHandler(handler)


def set_printer(printer: Callable[[str], None] | None) -> None:
    """Route lines through ``printer`` (a progress bar's console) instead of the stream."""
    global _printer
    _printer = printer


def info(message: str) -> None:
    _log.info(message, stacklevel=2)


def warning(message: str) -> None:
    _log.warning(message, stacklevel=2)


def error(message: str) -> None:
    _log.error(message, stacklevel=2)


def fmt(value: Any) -> str:
    """A number as C++'s ostream prints it by default (6 significant digits, like %g)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return "%g" % float(value)
