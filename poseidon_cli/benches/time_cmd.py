"""`poseidon bench time`: forward + backward of the engine beside the real Caffe and PyTorch, on
the CPU or (--gpu) a GPU."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click

from ..console import fail
from ..options import gpu_math_option


@click.command("time")
@click.option("--nets", default=None,
              help="Nets of the zoo to time [default: lenet,cifar10_quick,alexnet; with --gpu "
                   "also googlenet,vgg16,resnet50].")
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Alternating repetitions (the median is reported).")
@click.option("--iterations", type=int, default=None, help="Passes per timing (default per net).")
@click.option("--threads", default="1", show_default=True,
              help="BLAS threads of every peer: a number, or 'all' (this machine's cores).")
@click.option("--caffe", "caffe", default=None,
              help="A `caffe` binary (BVLC Caffe) to time in the same run; without it, Caffe's "
                   "recorded times are shown, labelled as recorded.")
@click.option("--gpu", type=int, default=None,
              help="Time on this GPU (CuPy and cuDNN; PyTorch on the same GPU) at GPU batch sizes.")
@gpu_math_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def time_cmd(nets: str | None, repeats: int, iterations: int | None, threads: str,
             caffe: str | None, gpu: int | None, gpu_math: str, json_path: str | None) -> None:
    """The engine's forward+backward next to Caffe and PyTorch, alternating runs."""
    from poseidon_cli.benches.comm import cpu_name_and_blas
    from poseidon_cli.benches.time import NETS, run, torch_available

    if nets is None:
        nets = "lenet,cifar10_quick,alexnet" + (",googlenet,vgg16,resnet50" if gpu is not None
                                                else "")
    if gpu is not None:
        from engine import backend
        if not backend.cupy_available():
            fail(f"--gpu {gpu}: CuPy with a CUDA GPU is not available on this machine "
                 "(pip install -e '.[gpu]' in Poseidon's checkout)")
    chosen = [n.strip() for n in nets.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in NETS]
    if unknown:
        fail(f"--nets: unknown {', '.join(unknown)} (choose from {', '.join(NETS)})")
    if repeats < 1 or (iterations is not None and iterations < 1):
        fail("--repeats and --iterations must be positive")
    n_threads = (os.cpu_count() or 1) if threads == "all" else int(threads) if threads.isdigit() else 0
    if n_threads < 1:
        fail(f"--threads must be a positive number or 'all', got {threads!r}")
    if caffe is not None:
        found = shutil.which(caffe)
        if found is None:
            fail(f"--caffe {caffe}: no such executable")
        caffe = found
    click.echo(f"machine: {cpu_name_and_blas()}; {n_threads} BLAS thread(s) per peer")
    if not torch_available():
        click.echo("PyTorch is not installed (pip install torch==2.13.0): no PyTorch peer")
    try:
        if gpu is not None:
            click.echo(f"GPU math: {gpu_math}; PyTorch: cudnn.benchmark on, TF32 off")
        report = run(chosen, repeats, iterations, n_threads, caffe, click.echo, gpu, gpu_math)
    except RuntimeError as e:
        fail(str(e))
    for peer, blas in report["blas"].items():
        click.echo(f"{peer:8} {blas}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
