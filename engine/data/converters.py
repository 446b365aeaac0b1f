"""Data sets -> Caffe LMDBs of Datum, as Caffe's converters write them; the image mean.

- MNIST / Fashion-MNIST (idx files, gzip or not) like tools/convert_mnist_data: keys
  ``%08d``, one-channel 28x28 Datum with the label. For the same images the records are
  byte-identical to Caffe's.
- CIFAR-10 binary batches like examples/cifar10/convert_cifar_data: keys ``%05d`` (the
  image's index in its batch file plus 10000 per file), 3x32x32 Datum holding the file's
  R, G, B planes as they are.
- scikit-learn's 8x8 digits (UCI optical digits, offline): pixel values 0..16 scaled to
  0..255 (round(v * 255 / 16)) so they look like an ordinary grey image; the last 297
  images are the test set, the first 1,500 the training set.
- compute_image_mean like tools/compute_image_mean: float32 mean over all records.
"""
from __future__ import annotations

import gzip
import importlib.util
import shutil
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from .datum import DataError, array_to_datum, datum_to_array, parse_datum
from .lmdb_source import open_db, write_lmdb

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
#: where each data set is published (MNIST's original site often refuses scripts: mirror first)
URLS = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/",
              "http://yann.lecun.com/exdb/mnist/"],
    "fashion-mnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
    "cifar10": ["https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"],
}
#: Debian's dataset-fashion-mnist package puts the idx files under /usr/share
FASHION_MNIST_GLOB = ("/usr/share", "*fashion*mnist*")
CIFAR_BATCH = 10000
DIGITS_TEST = 297


def read_idx(path: Path) -> np.ndarray:
    """An idx file (MNIST's format; ``.gz`` read transparently) as a uint8 array."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DataError(f"cannot read idx file {path}: {e}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an idx file of unsigned bytes")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    size = len(raw) - 4 - 4 * ndim
    if size != int(np.prod(dims)):
        raise DataError(f"{path}: header says {dims} but holds {max(size, 0)} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def datum_records(images: np.ndarray, labels: Sequence[int], keys: Iterable[str],
                  encode: str | None = None) -> Iterator[tuple[bytes, bytes]]:
    """(key, serialized Datum) for CHW uint8 images and their labels."""
    for key, image, label in zip(keys, images, labels):
        yield key.encode(), array_to_datum(image, int(label), encode).SerializeToString()


def write_images(path: Path, images: np.ndarray, labels: Sequence[int],
                 keys: Iterable[str] | None = None, encode: str | None = None,
                 overwrite: bool = False) -> int:
    """Write N x C x H x W uint8 images as an LMDB of Datum (keys ``%08d`` unless given)."""
    if images.ndim != 4 or images.dtype != np.uint8:
        raise DataError(f"expected N x C x H x W uint8 images, got {images.shape} {images.dtype}")
    if len(labels) != len(images):
        raise DataError(f"{len(images)} images but {len(labels)} labels")
    keys = keys if keys is not None else (f"{i:08d}" for i in range(len(images)))
    return write_lmdb(path, datum_records(images, labels, keys, encode), overwrite)


def _find(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder}: no {stem}[.gz]")


def load_idx_pair(folder: Path, split: str,
                  limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """MNIST-layout images (N, 1, H, W) and labels (N,) of ``split`` ("train"/"test")."""
    image_file, label_file = (_find(Path(folder), s) for s in MNIST_FILES[split])
    images, labels = read_idx(image_file), read_idx(label_file)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{image_file} ({images.shape}) and {label_file} ({labels.shape}) "
                        "do not match")
    return images[:limit, None], labels[:limit]


def convert_mnist(src: Path, out: Path, prefix: str = "mnist", limit: int | None = None,
                  overwrite: bool = False) -> dict[str, int]:
    """Write ``out/<prefix>_train_lmdb`` and ``<prefix>_test_lmdb``; returns record counts."""
    counts = {}
    for split in ("train", "test"):
        images, labels = load_idx_pair(src, split, limit)
        counts[f"{prefix}_{split}_lmdb"] = write_images(
            Path(out) / f"{prefix}_{split}_lmdb", images, labels, overwrite=overwrite)
    return counts


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 binary batch: images (N, 3, 32, 32) uint8 (R, G, B planes), labels (N,)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % 3073:
        raise DataError(f"{path}: {raw.size} bytes is not a whole number of CIFAR-10 records "
                        "(3073 bytes each)")
    rows = raw.reshape(-1, 3073)
    return rows[:, 1:].reshape(-1, 3, 32, 32), rows[:, 0].copy()


def convert_cifar10(src: Path, out: Path, overwrite: bool = False) -> dict[str, int]:
    """``src/data_batch_*.bin`` -> ``out/cifar10_train_lmdb``, ``test_batch.bin`` -> ``_test_``."""
    src = Path(src)
    train_files = sorted(src.glob("data_batch_*.bin"))
    if not train_files or not (src / "test_batch.bin").is_file():
        raise DataError(f"{src}: expected data_batch_*.bin and test_batch.bin "
                        "(CIFAR-10 binary version)")
    parts = [read_cifar_batch(f) for f in train_files]
    keys = [f"{i * CIFAR_BATCH + j:05d}" for i, (im, _) in enumerate(parts) for j in range(len(im))]
    counts = {"cifar10_train_lmdb": write_images(
        Path(out) / "cifar10_train_lmdb", np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]), keys, overwrite=overwrite)}
    images, labels = read_cifar_batch(src / "test_batch.bin")
    counts["cifar10_test_lmdb"] = write_images(
        Path(out) / "cifar10_test_lmdb", images, labels,
        (f"{j:05d}" for j in range(len(images))), overwrite=overwrite)
    return counts


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits as (1797, 1, 8, 8) uint8 (0..16 scaled to 0..255) and labels.

    Read from the file scikit-learn ships (64 pixels and the label per row, as its
    ``load_digits`` reads it) without importing scikit-learn, whose import takes 1.5 s."""
    spec = importlib.util.find_spec("sklearn")
    csv = (Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
           if spec is not None and spec.origin else None)
    if csv is None or not csv.is_file():
        raise DataError("the digits data set comes with scikit-learn "
                        "(pip install scikit-learn)")
    rows = np.loadtxt(csv, delimiter=",")
    images = np.rint(rows[:, :-1].reshape(-1, 1, 8, 8) * (255.0 / 16.0)).astype(np.uint8)
    return images, rows[:, -1].astype(np.int64)


def convert_digits(out: Path, overwrite: bool = False) -> dict[str, int]:
    """``out/digits_train_lmdb`` (first 1,500) and ``digits_test_lmdb`` (last 297)."""
    images, labels = digits_arrays()
    cut = len(images) - DIGITS_TEST
    return {
        "digits_train_lmdb": write_images(Path(out) / "digits_train_lmdb", images[:cut],
                                          labels[:cut], overwrite=overwrite),
        "digits_test_lmdb": write_images(Path(out) / "digits_test_lmdb", images[cut:],
                                         labels[cut:], overwrite=overwrite),
    }


def find_fashion_mnist() -> Path | None:
    """The folder of an installed Fashion-MNIST (Debian's dataset-fashion-mnist), if any."""
    root, pattern = FASHION_MNIST_GLOB
    for folder in sorted(Path(root).glob(pattern)):
        for hit in sorted(folder.rglob("train-images-idx3-ubyte*")):
            return hit.parent
    return None


def download(dataset: str, dest: Path) -> Path:
    """Fetch ``dataset``'s files into ``dest`` from its canonical location; returns the folder
    that holds them. A DataError naming the URL when offline."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = ([f + ".gz" for pair in MNIST_FILES.values() for f in pair]
             if dataset in ("mnist", "fashion-mnist") else [""])
    errors = []
    for base in URLS[dataset]:
        try:
            for name in names:
                target = dest / (name or Path(base).name)
                with urllib.request.urlopen(base + name, timeout=30) as r, \
                        open(target, "wb") as f:
                    shutil.copyfileobj(r, f)
            if dataset == "cifar10":
                with tarfile.open(target) as tar:
                    # the "data" filter refuses paths outside dest (Python >= 3.10.12)
                    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                    tar.extractall(dest, **safe)
                return dest / "cifar-10-batches-bin"
            return dest
        except (urllib.error.URLError, OSError, tarfile.TarError) as e:
            errors.append(f"{base}: {getattr(e, 'reason', e)}")
    raise DataError(f"cannot download {dataset} ({'; '.join(errors)}); are you offline? "
                    "Fetch the files yourself and pass --from DIR")


def compute_image_mean(db: Path, backend: str = "LMDB",
                       on_record: Callable[[int, int], None] | None = None
                       ) -> tuple[np.ndarray, int]:
    """Caffe's compute_image_mean: the float32 (C, H, W) mean of every record, and the count;
    ``on_record(done, total)`` follows the progress."""
    source = open_db(Path(db), backend)
    try:
        total: np.ndarray | None = None
        for k in range(len(source)):
            if on_record is not None:
                on_record(k, len(source))
            key, value = source.get(k)
            try:
                image = datum_to_array(parse_datum(value))
            except DataError as e:
                raise DataError(f"corrupt record {k} (key {key!r}) in {db}: {e}") from None
            if total is None:
                total = np.zeros(image.shape, dtype=np.float64)
            elif image.shape != total.shape:
                raise DataError(f"{db}: record {k} has shape {image.shape}, the first "
                                f"{total.shape}; a mean needs images of one size")
            total += image
        if on_record is not None:
            on_record(len(source), len(source))
    finally:
        source.close()
    assert total is not None  # open_db refuses an empty database
    n = len(source)
    # Caffe sums in float (exact for integer pixels below 2**24) and divides in float
    return total.astype(np.float32) / np.float32(n), n

