"""`poseidon device-query`: Caffe's `caffe device_query` — what this machine can compute on."""
from __future__ import annotations

import os
import platform

import click


@click.command("device-query")
@click.option("--gpu", type=int, default=None, help="Describe only this GPU.")
def device_query(gpu: int | None) -> None:
    """The CPU, NumPy's BLAS, and every CUDA GPU CuPy sees."""
    import numpy as np

    from engine import backend

    click.echo(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores")
    click.echo(f"Python {platform.python_version()}, NumPy {np.__version__}")
    blas = _blas_name(np)
    if blas:
        click.echo(f"BLAS: {blas}")
    if not backend.cupy_available():
        click.echo("GPU: none (CuPy with a CUDA device is not available)")
        return
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    for dev in range(count) if gpu is None else [gpu]:
        if not 0 <= dev < count:
            from ..console import fail
            fail(f"--gpu {dev}: this machine has {count} GPU(s)")
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        click.echo(f"Device id:                     {dev}")
        click.echo(f"Major revision number:         {props['major']}")
        click.echo(f"Minor revision number:         {props['minor']}")
        click.echo(f"Name:                          {name}")
        click.echo(f"Total global memory:           {props['totalGlobalMem']}")
        click.echo(f"Number of multiprocessors:     {props['multiProcessorCount']}")


def _blas_name(np_module) -> str:
    """The BLAS NumPy links (threadpoolctl-free: from NumPy's build config)."""
    try:
        cfg = np_module.show_config(mode="dicts")
        return str(cfg["Build Dependencies"]["blas"]["name"])
    except Exception:  # older NumPy without mode="dicts": not worth failing device-query over
        return ""
