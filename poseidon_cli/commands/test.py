"""`poseidon test`: Caffe's `caffe test` — score a trained net on its TEST-phase data."""
from __future__ import annotations

from pathlib import Path

import click

from ..console import fail, user_errors
from ..options import gpu_math_option


@click.command("test")
@click.option("--model", required=True, type=click.Path(dir_okay=False),
              help="Net prototxt (its TEST phase is scored).")
@click.option("--weights", required=True, help="Trained weights (.caffemodel or .caffemodel.h5).")
@click.option("--iterations", default=50, show_default=True, type=int,
              help="Batches to score.")
@click.option("--gpu", type=int, default=None, help="Run on this GPU (needs CuPy).")
@gpu_math_option
@click.option("--level", default=0, show_default=True, type=int, help="NetState level.")
@click.option("--stage", multiple=True, help="NetState stage (repeat for several).")
def test(model: str, weights: str, iterations: int, gpu: int | None, gpu_math: str, level: int,
         stage: tuple[str, ...]) -> None:
    """Per-batch outputs, then the mean of every output and the loss, as `caffe test` prints."""
    from engine import backend, glog
    from engine.evaluation import run_test_passes, score_line

    if iterations < 0:
        fail(f"--iterations must be >= 0, got {iterations}")
    for what, path in (("--model", model), ("--weights", weights)):
        if not Path(path).is_file():
            fail(f"{what}: {path} not found")
    with user_errors():
        if gpu is not None:
            backend.use_gpu(gpu, gpu_math)
            glog.info(backend.gpu_math_line())
        from engine.caffe_io import load_trained_weights
        from engine.net import Net
        net = Net(model, phase="TEST", level=level, stages=stage)
        load_trained_weights([net], weights)
        glog.info(f"Running for {iterations} iterations.")
        result = run_test_passes(
            net, iterations, on_batch=lambda i, name, v: glog.info(f"Batch {i}, {name} = {glog.fmt(v)}"))
        for layer in net.data_layers:
            if hasattr(layer, "close"):
                layer.close()
    glog.info(f"Loss: {glog.fmt(result.loss)}")
    for name, value, weight in result.scores:
        glog.info(score_line(name, value, weight))
