"""`poseidon data ...`: write Caffe-format LMDBs of Datum from public data sets; the image mean.

    poseidon data mnist --out DIR [--from DIR]        convert_mnist_data (downloads without --from)
    poseidon data fashion-mnist --out DIR [--from DIR]
    poseidon data cifar10 --out DIR [--from DIR]      convert_cifar_data (binary batches)
    poseidon data digits --out DIR                    scikit-learn's 8x8 digits, offline
    poseidon data images --list L --root DIR --out DB convert_imageset (or ROOT LIST DB)
    poseidon data mean DB --out mean.binaryproto      compute_image_mean (or DB OUT, --db DB)
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import click

from poseidon_cli.console import fail

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


def _positional(given: tuple[Path, ...], names: tuple[str, ...], options: dict[str, Path | None]
                ) -> tuple[Path | None, ...]:
    """Caffe's tools take their paths in order (``convert_imageset ROOT LIST DB``); the
    options name them. Either form, one value per path; the paths in ``names``' order."""
    if given and len(given) != len(names):
        fail(f"{len(given)} paths given: in Caffe's order they are {' '.join(names)} (or give "
             + ", ".join(f"--{o}" for o in options) + ")")
    if given and any(v is not None for v in options.values()):
        fail(f"give the paths in Caffe's order ({' '.join(names)}) or as "
             + ", ".join(f"--{o}" for o in options) + ", not both")
    return tuple(given) if given else tuple(options.values())


@data.command()
@click.argument("paths", nargs=-1, metavar="[ROOT LIST DB]", type=click.Path(path_type=Path))
@click.option("--list", "list_file", type=click.Path(dir_okay=False, path_type=Path),
              help="list file: one '<image path> <integer label>' per line")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path),
              help="folder the listed paths are relative to (default: as listed)")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path),
              help="LMDB folder to write")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb",
              show_default=True, help="the database to write (Poseidon writes LMDB)")
@click.option("--resize-height", "--resize_height", "resize_height", type=int, default=0,
              show_default=True, help="resize every image to this height (with --resize-width)")
@click.option("--resize-width", "--resize_width", "resize_width", type=int, default=0,
              show_default=True)
@click.option("--gray", is_flag=True, help="store grey images (one channel)")
@click.option("--shuffle", is_flag=True, help="shuffle the list's order")
@click.option("--seed", type=int, default=0, show_default=True, help="the shuffle's seed")
@click.option("--encoded", is_flag=True,
              help="store encoded images (PNG/JPEG bytes) rather than raw pixels")
@click.option("--encode-type", "--encode_type", "encode_type", default="",
              help="encoding to store (png, jpg, ...); default: each file's own")
@click.option("--check-size", "--check_size", "check_size", is_flag=True,
              help="every image must have the first one's size")
@click.option("--strict", is_flag=True, help="stop at the first bad image instead of skipping it")
@click.option("--decoders", type=click.IntRange(min=0), default=0, show_default=True,
              help="threads reading, decoding, resizing and encoding images (0: this "
                   "machine's usable cores, at most 4)")
@_FORCE
def images(paths: tuple[Path, ...], list_file: Path | None, root: Path | None, out: Path | None,
           backend: str, resize_height: int, resize_width: int, gray: bool, shuffle: bool,
           seed: int, encoded: bool, encode_type: str, check_size: bool, strict: bool,
           decoders: int, force: bool) -> None:
    """convert_imageset: the images of a list file -> an LMDB of Datum for a Data layer.

    The paths as options, or in Caffe's order: `poseidon data images ROOT LIST DB`. A bad
    image (missing, unreadable, not an image, the wrong size with --check-size) is reported
    by name and skipped; with --strict it stops the conversion and nothing is written.
    Interrupted (Ctrl-C), the records so far are kept: the same command continues from there
    (with another list or other options it says what changed; --force starts over).
    """
    from engine.data.datum import DataError
    from engine.data.imageset import (ImagesetOptions, Interrupted, ListEntry, convert_imageset,
                                      partial_path)
    from poseidon_cli.progress import CountProgress

    root, list_file, out = _positional(paths, ("ROOT", "LIST", "DB"),
                                       {"root": root, "list": list_file, "out": out})
    if list_file is None or out is None:
        fail("which images, and where to? `poseidon data images --list L [--root DIR] --out DB`"
             " (or Caffe's order: ROOT LIST DB)")
    if not list_file.is_file():
        fail(f"list file {list_file} not found")
    if root is not None and not root.is_dir():
        fail(f"image folder {root} not found")
    if backend != "lmdb":
        fail(f"--backend {backend}: Poseidon writes LMDB only (Caffe's default; a Data layer "
             "reads it with `backend: LMDB`)")
    opts = ImagesetOptions(resize_height, resize_width, gray, shuffle, seed, encoded,
                           encode_type, check_size, strict)
    start = time.perf_counter()
    resumed = partial_path(out).exists()
    with CountProgress("images") as progress:
        def skipped(entry: ListEntry, reason: str) -> None:
            progress.say(f"poseidon: skipping {entry.name} ({list_file}:{entry.line}): {reason}")

        announced = False

        def record(done: int, total: int) -> None:
            nonlocal announced
            if not announced:
                announced = True
                if resumed and done:
                    progress.say(f"poseidon: resuming {out}: {done} of {total} images were "
                                 f"done before")
            progress.update(done, total)
        try:
            written, n_skipped = convert_imageset(list_file, out, root, opts, force,
                                                  on_record=record, on_skip=skipped,
                                                  decoders=decoders)
        except Interrupted as e:
            progress.say(f"poseidon: {e}")
            raise SystemExit(130) from None
        except DataError as e:
            fail(str(e))
        except OSError as e:
            fail(f"cannot write {out}: {e.strerror or e}")
    seconds = time.perf_counter() - start
    click.echo(f"wrote {out}: {written} records, {n_skipped} bad "
               f"image{'' if n_skipped == 1 else 's'} skipped")
    click.echo(f"done in {seconds:.1f} s")


@data.command()
@click.argument("paths", nargs=-1, metavar="[DB [OUT]]", type=click.Path(path_type=Path))
@click.option("--db", type=click.Path(path_type=Path), help="LMDB to average (or give it as DB)")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path),
              help="mean file to write (.binaryproto; or give it as OUT)")
@click.option("--backend", type=click.Choice(["lmdb", "leveldb"]), default="lmdb",
              show_default=True)
def mean(paths: tuple[Path, ...], db: Path | None, out: Path | None, backend: str) -> None:
    """compute_image_mean: the mean image of a database, as a BlobProto.

    The paths as options, or in Caffe's order: `poseidon data mean DB OUT`."""
    from engine.data.converters import compute_image_mean
    from engine.data.datum import DataError
    from engine.data.transformer import write_mean_file
    from poseidon_cli.progress import CountProgress
    if len(paths) == 1 and db is None:  # `mean DB --out FILE`
        db = paths[0]
    else:
        db, out = _positional(paths, ("DB", "OUT"), {"db": db, "out": out})
    if db is None or out is None:
        fail("which database, and where to? `poseidon data mean DB OUT` (or --db DB --out FILE)")
    try:
        with CountProgress("mean") as progress:
            image, n = compute_image_mean(db, backend.upper(), on_record=progress.update)
        write_mean_file(out, image)
    except DataError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    click.echo(f"wrote {out}: mean of {n} images, shape {tuple(image.shape)}")
    for c, value in enumerate(image.reshape(image.shape[0], -1).mean(axis=1)):
        click.echo(f"mean_value channel [{c}]: {value:g}")
