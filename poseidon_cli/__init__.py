"""Poseidon's command line: `poseidon train | test | time | bench | simulate | convert | data`.

Importing any module of this package first sets up the process: one BLAS thread, unless the
user chose otherwise (see ``default_blas_threads``), and glibc's allocator kept from returning
big buffers to the kernel (engine/allocator.py). Every entry point (the ``poseidon`` script, a
worker started as ``python -m poseidon_cli.launch.worker``, a PS shard) comes through here
before NumPy loads and before any thread starts.
"""
from __future__ import annotations

import os


def default_blas_threads() -> None:
    """One BLAS thread per process unless the user chose otherwise (OPENBLAS_NUM_THREADS...).

    Poseidon scales by processes (one worker per core or GPU), and OpenBLAS's spinning
    threads fight the prefetch thread and the other workers: the digits demo took 47 s with
    the default threads on a busy 2-core machine and 1.4 s with one. One thread is also how
    the real Caffe's reference numbers were made. Must run before NumPy is imported.
    """
    if not any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                          "MKL_NUM_THREADS")):
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"


# At import, not in the group's callback: click imports a command's module (which may import
# NumPy) before that callback runs.
default_blas_threads()

from engine.allocator import tune_allocator  # noqa: E402  (after the BLAS setting: it loads engine)

tune_allocator()
