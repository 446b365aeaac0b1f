"""How every command reports bad input: one line, ``poseidon: error: ...``, and a non-zero exit.

Each command module imports these; the ``poseidon`` group (main.py) imports the commands, so
this module sits below both.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
from typing import Callable, Iterator, NoReturn

import click


#: where each kind of Caffe file goes (engine/caffe_io/kinds.py names the kinds)
TAKEN_BY = {
    "net": "a net goes to `poseidon test|time --model`, or into a solver's `net:`",
    "solver": "a solver goes to `poseidon train --solver`",
    "caffemodel": "weights go to `--weights`",
    "solverstate": "resume from it with `poseidon train --snapshot`",
    "binaryproto": "a mean image goes into a data layer's `transform_param { mean_file }`",
}


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the engine's errors about bad input into one line and a non-zero exit.

    Set POSEIDON_DEBUG=1 to see the traceback instead.
    """
    try:
        yield
    except BrokenPipeError:
        raise  # a reader that stopped reading (`| head`): click ends quietly
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        if os.environ.get("POSEIDON_DEBUG"):
            raise
        hint = TAKEN_BY.get(getattr(e, "kind", None), "")  # a file of another kind (caffe_io)
        fail((str(e) or type(e).__name__) + (f": {hint}" if hint else ""))
    except MemoryError as e:  # what the up-front size checks could not foresee
        if os.environ.get("POSEIDON_DEBUG"):
            raise
        fail(f"out of memory{': ' + str(e) if str(e) else ''} (a smaller batch, or a machine "
             "with more memory?)")


def plural(n: int, word: str) -> str:
    """'1 worker', '2 workers'."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def fail(message: str, code: int = 1) -> NoReturn:
    """Print a one-line error and exit non-zero: the one way commands report bad input."""
    click.echo(f"poseidon: error: {message}", err=True)
    sys.exit(code)


def run_process(main: Callable[[], object]) -> NoReturn:
    """Run a process's entry point ``main`` and end the process as Python would, less the
    interpreter's teardown of every module: other threads are joined, atexit's handlers run
    and the streams are flushed, then the process exits with ``main``'s code (its return
    value, or its SystemExit's). The teardown would free numba's and LLVM's compiled code one
    object at a time: a quarter of a second of CPU for every worker, shard and warm-up
    process of every job, and nothing is left for it to save."""
    try:
        code: object = main()
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as sys.exit("message") would
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (`| head`), or closed
            pass
    if _mpi_finalized():
        # MPICH's launcher takes a rank that ends by _exit after MPI_Finalize for a failed
        # one and kills the ranks still exiting (10 of 15 runs of 4 ranks here): C's exit
        # runs the MPI library's own exit handlers, and still not the interpreter's teardown
        ctypes.CDLL(None).exit(code or 0)
    os._exit(code or 0)


def _mpi_finalized() -> bool:
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and MPI.Is_finalized()
