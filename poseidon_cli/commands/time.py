"""`poseidon time`: Caffe's `caffe time` — per-layer forward/backward times of a net."""
from __future__ import annotations

import json
import logging
import sys

import click

from ..console import fail, user_errors
from ..options import gpu_math_option


@click.command("time")
@click.option("--model", required=True, type=click.Path(dir_okay=False),
              help="Net prototxt to time.")
@click.option("--iterations", default=50, show_default=True, type=int,
              help="Timed forward+backward passes (after one warm-up pass).")
@click.option("--phase", default="TRAIN", type=click.Choice(["TRAIN", "TEST"]), show_default=True)
@click.option("--gpu", type=int, default=None, help="Run on this GPU (needs CuPy).")
@gpu_math_option
@click.option("--synthetic", is_flag=True,
              help="Replace the data layers by Input layers of the shapes they would give "
                   "(zeros): time a train_val net without its database.")
@click.option("--batch", type=int, default=None,
              help="With --synthetic: the batch size (default: the data layers').")
@click.option("--input-shape", default=None,
              help="With --synthetic: C,H,W of a data layer whose shape is unknown.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON (a layer trace `poseidon simulate --trace` reads).")
def time_cmd(model: str, iterations: int, phase: str, gpu: int | None, gpu_math: str,
             synthetic: bool, batch: int | None, input_shape: str | None, as_json: bool) -> None:
    """Average forward, backward and per-layer times, as `caffe time` prints them."""
    from engine import backend
    from engine.perf.timing import time_net

    if iterations < 1:
        fail(f"--iterations must be positive, got {iterations}")
    if (batch is not None or input_shape) and not synthetic:
        fail("--batch and --input-shape shape the inputs of --synthetic; add --synthetic")
    if batch is not None and batch < 1:
        fail(f"--batch must be positive, got {batch}")
    with user_errors():
        if gpu is not None:
            backend.use_gpu(gpu, gpu_math)
        from engine.net import Net
        if synthetic:
            from pathlib import Path
            from engine.perf.netinfo import read_train_net, with_inputs
            from ..options import parse_shape
            if phase != "TRAIN":
                fail("--synthetic times the TRAIN phase's net; drop --phase TEST")
            param, _ = with_inputs(read_train_net(model), batch, input_shape=parse_shape(input_shape),
                                   where=Path(model).parent)
            net = Net(param, phase="TRAIN")
        else:
            net = Net(model, phase=phase)
        # `caffe time`'s log lines, so a long run (or one piped into a file) is never silent
        log = logging.getLogger("poseidon.time")
        log.info("*** Benchmark begins *** (%s, %d iterations after one warm-up pass)",
                 net.name, iterations)
        report = time_net(net, iterations, each=lambda i, ms: log.info(
            "Iteration: %d forward-backward time: %.3f ms.", i, ms))
        log.info("*** Benchmark ends ***")
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=1))
        return
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        table = Table(title=f"{report.net}: {iterations} iterations (ms per iteration)")
        for col in ("layer", "type", "forward", "backward"):
            table.add_column(col, justify="left" if col in ("layer", "type") else "right")
        for l in report.layers:
            table.add_row(l.name, l.type, f"{l.forward_ms:.3f}", f"{l.backward_ms:.3f}")
        table.add_row("total", "", f"{report.forward_ms:.3f}", f"{report.backward_ms:.3f}")
        Console().print(table)
        click.echo(f"Average Forward-Backward: {report.total_ms:.3f} ms.")
        return
    for l in report.layers:
        click.echo(f"{l.name:>12}\tforward: {l.forward_ms:.5f} ms.")
        click.echo(f"{l.name:>12}\tbackward: {l.backward_ms:.5f} ms.")
    click.echo(f"Average Forward pass: {report.forward_ms:.5f} ms.")
    click.echo(f"Average Backward pass: {report.backward_ms:.5f} ms.")
    click.echo(f"Average Forward-Backward: {report.total_ms:.5f} ms.")
