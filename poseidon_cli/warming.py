"""Compiling the engine's CPU kernels (Numba) ahead of the work that needs them: in parallel
processes, one per module and float type, each saying which kernel it compiles, once per
machine (Numba caches them beside the package; a stamp says this machine has warmed).
`poseidon warmup` runs it for both float types; `poseidon train` warms float32 itself when the
machine has not, so no training stalls silently.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import click

from .console import run_process

#: the modules with compiled kernels, each with ``warm(dtype)``; one job per module and dtype
PARTS = ("engine.kernels.cpu", "engine.kernels.cpu_pool", "engine.layers.winograd")
#: the float types nets compute in; training's nets are float32
DTYPES = ("float32", "float64")
#: a liveness bound for one part (its kernels compile in 5-10 s on an idle core)
PART_TIMEOUT_S = 600


def numba_wanted() -> bool:
    """Whether the engine uses the compiled kernels here (engine/kernels/cpu.py's rule)."""
    return (importlib.util.find_spec("numba") is not None
            and os.environ.get("POSEIDON_NUMBA", "1") != "0")


def _source(module: str) -> Path:
    """The source file of ``module``, found without importing its packages (engine.layers
    imports every layer, Numba and SciPy: the launcher of a distributed run needs none)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.joinpath(*rest)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def stamp_path(dtype: str) -> Path | None:
    """The file that says this machine has compiled ``dtype``'s kernels from these sources:
    beside Numba's cache (NUMBA_CACHE_DIR, else engine/kernels/__pycache__), named by a digest
    of the sources, Numba's and Python's versions and this host's name (a cache on a shared
    file system serves machines whose CPUs may differ). None when that folder is not
    writable (Numba then caches elsewhere, and the warm-up runs each time: quick when
    cached)."""
    from importlib.metadata import version

    folder = Path(os.environ.get("NUMBA_CACHE_DIR") or _source("engine.kernels").parent /
                  "__pycache__")
    digest = hashlib.sha256()
    for part in PARTS:
        digest.update(_source(part).read_bytes())
    digest.update(f"{version('numba')} {sys.version} {platform.node()} {dtype}".encode())
    if not os.access(folder if folder.is_dir() else folder.parent, os.W_OK):
        return None
    return folder / f"poseidon-warm-{dtype}-{digest.hexdigest()[:16]}.stamp"


def warm_kernels(dtypes: Sequence[str], say: Callable[[str], None], force: bool = True) -> bool:
    """Compile (or load from the cache) every part's kernels for ``dtypes``, saying each kernel
    that compiles. A dtype this machine has not compiled yet (no stamp) compiles in parallel
    processes; a stamped one loads here (quick), and only with ``force``. False when Numba is
    not in use (nothing to compile). Raises RuntimeError naming the part that failed."""
    if not numba_wanted():
        return False
    stamps = {d: stamp_path(d) for d in dtypes}
    cold = [d for d, p in stamps.items() if p is None or not p.exists()]
    warm = [d for d in dtypes if d not in cold and force]
    if not cold and not warm:
        return True
    start = time.monotonic()
    if cold:
        jobs = [(part, dtype) for dtype in cold for part in PARTS]
        width = max(1, min(len(jobs), len(os.sched_getaffinity(0))))
        say(f"Compiling the CPU kernels ({', '.join(cold)}) for this machine in {width} "
            "processes, once: what Numba has cached loads instead")
        compiled = _run_parts(jobs, width)
    else:
        compiled = []
    for dtype in warm:  # each part in this process: a kernel the cache lacks compiles here
        compiled += warm_part(dtype)
    for dtype in cold:
        if (p := stamps[dtype]) is not None:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("this machine has compiled the CPU kernels of these sources\n")
    say(f"The CPU kernels ({', '.join(dtypes)}) are ready: {len(compiled)} compiled, the others "
        f"loaded from the cache ({time.monotonic() - start:.1f} s)")
    return True


def _run_parts(jobs: list[tuple[str, str]], width: int) -> list[str]:
    """Run each (part, dtype) job in a process of its own, ``width`` at a time: the labels of
    the kernels they compiled."""
    compiled: list[str] = []
    running: list[tuple[str, subprocess.Popen, float]] = []
    try:
        while jobs or running:
            while jobs and len(running) < width:
                part, dtype = jobs.pop(0)
                running.append((f"{part} {dtype}", subprocess.Popen(
                    [sys.executable, "-m", "poseidon_cli.warming", part, dtype],
                    stdout=subprocess.PIPE, text=True), time.monotonic() + PART_TIMEOUT_S))
            time.sleep(0.05)
            for job in list(running):
                done = _collect(*job)
                if done is not None:
                    compiled += done
                    running.remove(job)
    finally:  # one failed (or Ctrl-C): the others stop too
        for _, proc, _ in running:
            proc.kill()
            proc.wait()
    return compiled


def _collect(name: str, proc: subprocess.Popen, deadline: float) -> list[str] | None:
    """The kernels ``proc`` compiled, once it is done (None while it runs); RuntimeError when
    it failed or outlived its deadline."""
    if proc.poll() is None:
        if time.monotonic() < deadline:
            return None
        raise RuntimeError(f"compiling the kernels of {name} took over {PART_TIMEOUT_S} s; "
                           "stopped it")
    out = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise RuntimeError(f"compiling the kernels of {name} failed (exit code "
                           f"{proc.returncode}); POSEIDON_NUMBA=0 runs the NumPy forms instead")
    return out.split()


def warm_part(dtype: str, parts: Sequence[str] = PARTS) -> list[str]:
    """``parts``' kernels for ``dtype`` in this process: the labels of those that compiled
    (each said as it starts) rather than loaded from the cache."""
    import numpy as np

    from engine.kernels import cpu

    compiled: list[str] = []

    def said(label: str) -> None:
        compiled.append(label.replace(" ", ":"))
        click.echo(f"poseidon:   compiling {label}", err=True)

    cpu.report_compiles(said)
    try:
        for part in parts:
            importlib.import_module(part).warm(np.dtype(dtype))
    finally:
        cpu.report_compiles(None)
    return compiled


def echo(message: str) -> None:
    """A warm-up line, as `poseidon` says it."""
    click.echo(f"poseidon: {message}", err=True)


if __name__ == "__main__":  # one job of warm_kernels: PART DTYPE; says what it compiled
    run_process(lambda: click.echo(" ".join(warm_part(sys.argv[2], [sys.argv[1]]))))
