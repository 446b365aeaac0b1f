"""`poseidon bench data`: the data path alone (Data layer + Silence) beside the real Caffe."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from ..console import fail


@click.command("data")
@click.option("--db", "dbs", multiple=True, type=click.Path(exists=True, file_okay=False,
                                                            path_type=Path),
              help="An LMDB of Datum records to read (repeat for several); default: a raw and "
                   "a JPEG LMDB of 512 sample pictures, made for the run.")
@click.option("--net", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Take the batch size and transform_param of this net's TRAIN "
                                 "Data layer [default: batch 128, crop 227, mirror, 3 mean values].")
@click.option("--decoders", default="1,2,4", show_default=True,
              help="Decoder thread counts to time (data_param.decoders).")
@click.option("--iterations", type=click.IntRange(min=1), default=20, show_default=True,
              help="Batches per timing.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating repetitions (the median is reported).")
@click.option("--caffe", default=None,
              help="A `caffe` binary (BVLC Caffe) to time on the same data-only net.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def data(dbs: tuple[Path, ...], net: Path | None, decoders: str, iterations: int, repeats: int,
         caffe: str | None, json_path: str | None) -> None:
    """Records/s of the Data layer (read, decode, transform, prefetch wait) per decoder count."""
    from poseidon_cli.benches.comm import cpu_name_and_blas
    from poseidon_cli.benches.data import DataNet, run, with_sample_dbs

    try:
        counts = [int(d) for d in decoders.split(",") if d.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        fail(f"--decoders: positive counts separated by commas, got {decoders!r}")
    if caffe is not None:
        found = shutil.which(caffe)
        if found is None:
            fail(f"--caffe {caffe}: no such executable")
        caffe = found
    try:
        spec = DataNet.from_net(net) if net is not None else DataNet()
    except ValueError as e:
        fail(str(e))
    named = {p.name: p.resolve() for p in dbs} or None
    click.echo(f"machine: {cpu_name_and_blas()}; batch {spec.batch}, transform_param "
               f"{{ {spec.transform} }}, {iterations} batches a run, {repeats} runs")
    if caffe is None:
        click.echo("no --caffe: Poseidon alone")
    try:
        report = with_sample_dbs(named, lambda d, folder: run(
            d, counts, spec, iterations, repeats, caffe, folder, click.echo))
    except RuntimeError as e:
        fail(str(e))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
