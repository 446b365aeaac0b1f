"""`poseidon data ...`: write Caffe-format LMDBs of Datum from public data sets; the image mean.

    poseidon data mnist --out DIR [--from DIR]        convert_mnist_data (downloads without --from)
    poseidon data fashion-mnist --out DIR [--from DIR]
    poseidon data cifar10 --out DIR [--from DIR]      convert_cifar_data (binary batches)
    poseidon data digits --out DIR                    scikit-learn's 8x8 digits, offline
    poseidon data mean --db DIR --out mean.binaryproto   compute_image_mean
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import click

from poseidon_cli.main import fail

_OUT = click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
                    help="folder to write the <name>_train_lmdb and <name>_test_lmdb into")
_FROM = click.option("--from", "src", type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="folder holding the data set's original files (default: download)")
_FORCE = click.option("--force", is_flag=True, help="replace LMDBs that already exist")


@click.group()
def data() -> None:
    """Write Caffe-format LMDBs (Datum records) from public data sets."""


def _report(counts: dict[str, int], out: Path, seconds: float) -> None:
    for name, n in counts.items():
        click.echo(f"wrote {out / name}: {n} records")
    click.echo(f"done in {seconds:.1f} s")


def _run(convert: Callable[[], dict[str, int]], out: Path) -> None:
    from engine.data.datum import DataError
    start = time.perf_counter()
    try:
        counts = convert()
    except DataError as e:
        fail(str(e))
    _report(counts, out, time.perf_counter() - start)


def _with_source(dataset: str, src: Path | None, convert: Callable[[Path], dict[str, int]],
                 out: Path) -> None:
    """Convert from ``src``, or from a download into a scratch folder removed afterwards."""
    from engine.data import converters
    if src is not None:
        _run(lambda: convert(src), out)
        return
    scratch = Path(tempfile.mkdtemp(prefix="poseidon-data-"))
    try:
        click.echo(f"downloading {dataset} from {converters.URLS[dataset][0]} ...")
        _run(lambda: convert(converters.download(dataset, scratch)), out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@data.command()
@_OUT
@_FROM
@_FORCE
def mnist(out: Path, src: Path | None, force: bool) -> None:
    """MNIST -> mnist_train_lmdb (60,000) and mnist_test_lmdb (10,000), like convert_mnist_data."""
    from engine.data.converters import convert_mnist
    _with_source("mnist", src, lambda s: convert_mnist(s, out, "mnist", overwrite=force), out)


@data.command("fashion-mnist")
@_OUT
@_FROM
@_FORCE
def fashion_mnist(out: Path, src: Path | None, force: bool) -> None:
    """Fashion-MNIST -> fashion_mnist_train_lmdb and fashion_mnist_test_lmdb.

    Without --from, an installed copy (Debian's dataset-fashion-mnist) is used, else downloaded.
    """
    from engine.data.converters import convert_mnist, find_fashion_mnist
    src = src or find_fashion_mnist()
    _with_source("fashion-mnist", src,
                 lambda s: convert_mnist(s, out, "fashion_mnist", overwrite=force), out)


@data.command()
@_OUT
@_FROM
@_FORCE
def cifar10(out: Path, src: Path | None, force: bool) -> None:
    """CIFAR-10 binary batches -> cifar10_train_lmdb and cifar10_test_lmdb (convert_cifar_data)."""
    from engine.data.converters import convert_cifar10
    _with_source("cifar10", src, lambda s: convert_cifar10(s, out, overwrite=force), out)


@data.command()
@_OUT
@_FORCE
def digits(out: Path, force: bool) -> None:
    """scikit-learn's 8x8 digits -> digits_train_lmdb (1,500) and digits_test_lmdb (297).

    Pixels 0..16 are scaled to 0..255; works offline.
    """
    from engine.data.converters import convert_digits
    _run(lambda: convert_digits(out, overwrite=force), out)


@data.command()
@click.option("--db", required=True, type=click.Path(path_type=Path), help="LMDB to average")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="mean file to write (.binaryproto)")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb",
              show_default=True)
def mean(db: Path, out: Path, backend: str) -> None:
    """compute_image_mean: the mean image of a database, as a BlobProto."""
    from engine.data.converters import compute_image_mean
    from engine.data.datum import DataError
    from engine.data.transformer import write_mean_file
    try:
        image, n = compute_image_mean(db, backend.upper())
        write_mean_file(out, image)
    except DataError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    click.echo(f"wrote {out}: mean of {n} images, shape {tuple(image.shape)}")
    for c, value in enumerate(image.reshape(image.shape[0], -1).mean(axis=1)):
        click.echo(f"mean_value channel [{c}]: {value:g}")
