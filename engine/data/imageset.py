"""Caffe's convert_imageset: a list of ``<image path> <label>`` lines -> an LMDB of Datum.

Each image is read as Caffe's ReadImageToDatum reads it (engine/data/datum.load_image: BGR
or grey, OpenCV's bilinear resize) and stored raw (C x H x W bytes) or encoded: with an
encoding and no resize the file's own bytes when its extension names that encoding,
otherwise the decoded pixels re-encoded. Keys are Caffe's, ``%08d_<path>`` with the line's
index in the (shuffled) list. Unlike Caffe, a ``root`` is joined as a folder (Caffe pastes the
strings together, so its users write a trailing slash; both work here).

The LMDB is written beside its destination and moved into place only when complete: a
failure leaves any previous database as it was.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np

from ..pb import caffe_pb2
from .datum import DataError, array_to_datum, load_image
from .lmdb_source import write_lmdb


class ListEntry(NamedTuple):
    name: str
    label: int
    line: int  # 1-based line in the list file


@dataclass(frozen=True)
class ImagesetOptions:
    """convert_imageset's flags."""

    resize_height: int = 0
    resize_width: int = 0
    gray: bool = False
    shuffle: bool = False
    #: the shuffle's seed (Caffe's is unseeded; a fixed one makes the database reproducible)
    seed: int = 0
    encoded: bool = False
    #: the encoding ("png", "jpg", ...); empty with ``encoded``: each file's own extension
    encode_type: str = ""
    check_size: bool = False
    #: stop at the first bad image instead of skipping it
    strict: bool = False


def read_image_list(path: Path) -> list[ListEntry]:
    """The entries of an image list (``<path> <integer label>`` per line, blank lines
    skipped; the path may contain spaces: the label follows the last one)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read image list {path}: {getattr(e, 'strerror', None) or e}"
                        ) from None
    entries = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        name, _, label = line.rpartition(" ")
        try:
            entries.append(ListEntry(name.strip(), int(label), n))
        except ValueError:
            raise DataError(f"{path}:{n}: expected '<image path> <integer label>', "
                            f"got {line!r}") from None
        if not entries[-1].name:
            raise DataError(f"{path}:{n}: no image path before the label in {line!r}")
    if not entries:
        raise DataError(f"image list {path} is empty")
    return entries


def _same_encoding(filename: str, encoding: str) -> bool:
    """Caffe's matchExt: the file's extension names ``encoding`` (jpg and jpeg are one)."""
    ext = os.path.splitext(filename)[1][1:].lower()
    aliases = {"jpg": "jpeg"}
    return bool(ext) and aliases.get(ext, ext) == aliases.get(encoding.lower(), encoding.lower())


def _pillow_format(encoding: str) -> str:
    from PIL import Image

    fmt = Image.registered_extensions().get("." + encoding.lower())
    if fmt is None:
        raise DataError(f"unknown encode_type {encoding!r} (Pillow cannot write it; try png "
                        "or jpg)")
    return fmt


def image_datum(path: Path, label: int, opts: ImagesetOptions) -> tuple[caffe_pb2.Datum,
                                                                         tuple[int, ...]]:
    """Caffe's ReadImageToDatum for one image: the Datum and the decoded C x H x W shape."""
    chw = load_image(path, not opts.gray, opts.resize_height, opts.resize_width)
    encoding = opts.encode_type or (os.path.splitext(str(path))[1][1:] if opts.encoded else "")
    if not encoding:
        return array_to_datum(chw, label), chw.shape
    if not (opts.resize_height or opts.resize_width) and _same_encoding(str(path), encoding):
        data = Path(path).read_bytes()  # the file as it is (Caffe's ReadFileToDatum)
    else:
        data = array_to_datum(chw, 0, _pillow_format(encoding)).data
    # Caffe's encoded records carry no channels/height/width: the bytes say them
    return caffe_pb2.Datum(data=data, label=int(label), encoded=True), chw.shape


_LMDB_FILES = ("data.mdb", "lock.mdb")
OnRecord = Callable[[int, int], None]
OnSkip = Callable[[ListEntry, str], None]


def _records(entries: list[ListEntry], root: Path | None, opts: ImagesetOptions,
             on_record: OnRecord | None, on_skip: OnSkip | None, where: str
             ) -> Iterator[tuple[bytes, bytes]]:
    first_shape: tuple[int, ...] | None = None
    for index, entry in enumerate(entries):
        path = Path(root) / entry.name if root is not None else Path(entry.name)
        try:
            datum, shape = image_datum(path, entry.label, opts)
            if opts.check_size:
                first_shape = first_shape or shape
                if shape != first_shape:
                    raise DataError(f"{path}: shape {shape} differs from the first image's "
                                    f"{first_shape} (check_size)")
        except DataError as e:
            if opts.strict:
                raise DataError(f"{where}:{entry.line}: {e}") from None
            if on_skip is not None:
                on_skip(entry, str(e))
        else:
            yield f"{index:08d}_{entry.name}".encode(), datum.SerializeToString()
        if on_record is not None:
            on_record(index + 1, len(entries))


def convert_imageset(list_file: Path, out: Path, root: Path | None = None,
                     opts: ImagesetOptions = ImagesetOptions(), overwrite: bool = False,
                     on_record: OnRecord | None = None, on_skip: OnSkip | None = None
                     ) -> tuple[int, int]:
    """Write the LMDB ``out`` from ``list_file``; returns (records written, images skipped).

    ``on_record(done, total)`` follows the progress; ``on_skip(entry, reason)`` hears of each
    bad image skipped (with ``opts.strict`` the first one raises a DataError instead).
    """
    out = Path(out)
    if (out / "data.mdb").exists() and not overwrite:
        raise DataError(f"{out} already exists (remove it, or pass --force)")
    if out.exists() and (not out.is_dir() or set(os.listdir(out)) - set(_LMDB_FILES)):
        raise DataError(f"{out} exists and is not an LMDB folder: choose a new path")
    if (opts.resize_height > 0) != (opts.resize_width > 0):
        raise DataError("resize_height and resize_width must be given together")
    entries = read_image_list(Path(list_file))
    if opts.shuffle:
        order = np.random.default_rng(opts.seed).permutation(len(entries))
        entries = [entries[i] for i in order]
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    skipped = [0]

    def skip(entry: ListEntry, reason: str) -> None:
        skipped[0] += 1
        if on_skip is not None:
            on_skip(entry, reason)

    try:
        written = write_lmdb(scratch, _records(entries, root, opts, on_record, skip,
                                               str(list_file)))
        if written == 0:
            raise DataError(f"{list_file}: none of its {len(entries)} images could be read")
        if out.exists():  # an LMDB folder, or an empty one (checked above)
            for name in _LMDB_FILES:
                (out / name).unlink(missing_ok=True)
            out.rmdir()
        os.replace(scratch, out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return written, skipped[0]
