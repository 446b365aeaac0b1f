"""`poseidon warmup`: compile the engine's CPU kernels (Numba) now, where waiting is expected,
instead of in the first iterations of the first training.

Numba compiles a kernel the first time it runs, about a second each (some 30 over every
kernel and both float types, on one core), and caches the result on disk beside the package,
so this is paid once per machine. The parts compile in parallel processes (Numba compiles
one kernel at a time per process), each saying which kernel it compiles. `poseidon train`
warms float32 itself when this machine has not (a stamp beside Numba's cache says it has), so
no training stalls silently. Run again, it loads every kernel from the cache: quick.
"""
from __future__ import annotations

import click

from ..console import fail
from ..warming import DTYPES, echo, warm_kernels


@click.command("warmup")
@click.option("--dtype", "dtypes", type=click.Choice(DTYPES), multiple=True,
              help="Only this float type (repeat for several).  [default: all]")
def warmup(dtypes: tuple[str, ...]) -> None:
    """Compile the CPU kernels for this machine now (once; quick when they are cached)."""
    try:
        if not warm_kernels(dtypes or DTYPES, echo):
            echo("Numba is not in use here (`pip install -e '.[fast]'` adds it, and "
                 "POSEIDON_NUMBA=0 turns it off): the NumPy forms serve, nothing to compile")
    except RuntimeError as e:
        fail(str(e))
