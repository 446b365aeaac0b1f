"""`poseidon bench time`: forward + backward of the engine beside PyTorch CPU."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .main import fail


@click.command("time")
@click.option("--nets", default="lenet,cifar10_quick,alexnet", show_default=True,
              help="Nets of the zoo to time.")
@click.option("--repeats", type=int, default=3, show_default=True,
              help="Alternating repetitions (the median is reported).")
@click.option("--iterations", type=int, default=None, help="Passes per timing (default per net).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def time_cmd(nets: str, repeats: int, iterations: int | None, json_path: str | None) -> None:
    """The engine's forward+backward (one thread) next to PyTorch CPU, alternating runs."""
    from engine.perf.bench_comm import cpu_name_and_blas
    from engine.perf.bench_time import NETS, run, torch_available

    chosen = [n.strip() for n in nets.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in NETS]
    if unknown:
        fail(f"--nets: unknown {', '.join(unknown)} (choose from {', '.join(NETS)})")
    if repeats < 1 or (iterations is not None and iterations < 1):
        fail("--repeats and --iterations must be positive")
    click.echo(f"machine: {cpu_name_and_blas()}")
    if not torch_available():
        click.echo("PyTorch is not installed (pip install torch==2.13.0): the engine alone, "
                   "no ratio")
    try:
        report = run(chosen, repeats, iterations, click.echo)
    except RuntimeError as e:
        fail(str(e))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
