"""Caffe's convert_imageset: a list of ``<image path> <label>`` lines -> an LMDB of Datum.

Each image is read as Caffe's ReadImageToDatum reads it (engine/data/datum.load_image: BGR
or grey, OpenCV's bilinear resize) and stored raw (C x H x W bytes) or encoded: with an
encoding and no resize the file's own bytes when its extension names that encoding,
otherwise the decoded pixels re-encoded. Keys are Caffe's, ``%08d_<path>`` with the line's
index in the (shuffled) list. Unlike Caffe, a ``root`` is joined as a folder (Caffe pastes the
strings together, so its users write a trailing slash; both work here).

Several decoding threads (engine.data.decoders) make the records, which are written in list
order. The LMDB is written beside its destination (``partial_path``) and moved into place
only when complete: a failure leaves any previous database as it was. An interruption
(Ctrl-C) keeps the records written so far and a progress file; the same conversion run
again continues from there, and a different one (another list, other options) is refused,
saying what changed.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from ..pb import caffe_pb2
from .datum import DataError, array_to_datum, load_image
from .decoders import DecoderPool, Pending, default_decoders
from .lmdb_source import open_lmdb_writer


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
#: the progress file beside the records of an unfinished conversion
PROGRESS = "poseidon-progress.json"
OnRecord = Callable[[int, int], None]
OnSkip = Callable[[ListEntry, str], None]
#: images decoded per hand-over to the decoders; a checkpoint is taken every few of these
CHUNK = 256
#: seconds between checkpoints (a commit and the progress file): what an interruption loses
CHECKPOINT_S = 2.0


class Interrupted(Exception):
    """The conversion was stopped (Ctrl-C); its records so far are kept for a resume."""

    def __init__(self, done: int, total: int, partial: Path):
        super().__init__(f"interrupted after {done} of {total} images; the records so far are "
                         f"kept in {partial}: run the same command again to continue")
        self.done, self.total, self.partial = done, total, partial


def partial_path(out: Path) -> Path:
    """Where an unfinished conversion to ``out`` keeps its records and progress."""
    return out.parent / f".{out.name}.partial"


def _signature(list_file: Path, root: Path | None, opts: ImagesetOptions) -> dict[str, Any]:
    """What the records depend on: a resume must be of the same conversion."""
    digest = hashlib.sha256(Path(list_file).read_bytes()).hexdigest()
    return {"list": str(Path(list_file).resolve()), "list_sha256": digest,
            "root": str(Path(root).resolve()) if root is not None else None,
            "options": dataclasses.asdict(opts)}


@dataclass
class _Progress:
    """An unfinished conversion: entries before ``next`` are done (written or skipped)."""

    signature: dict[str, Any]
    next: int = 0
    written: int = 0
    skipped: int = 0
    first_shape: list[int] | None = None

    def save(self, folder: Path) -> None:
        tmp = folder / f"{PROGRESS}.tmp"
        tmp.write_text(json.dumps(dataclasses.asdict(self)))
        os.replace(tmp, folder / PROGRESS)


def _resume(partial: Path, signature: dict[str, Any], overwrite: bool) -> _Progress:
    """The progress to continue from in ``partial`` (made if absent), or why it cannot be."""
    if partial.exists():
        try:
            state = _Progress(**json.loads((partial / PROGRESS).read_text()))
        except (OSError, ValueError, TypeError) as e:
            state, reason = None, f"its progress file is unreadable ({e})"
        else:
            changed = [k for k in ("list", "list_sha256", "root") if
                       state.signature.get(k) != signature[k]]
            changed += [f"--{k.replace('_', '-')}" for k, v in signature["options"].items()
                        if state.signature.get("options", {}).get(k) != v]
            reason = (f"it was started with another {', '.join(changed)}" if changed else "")
        if not reason:
            return state
        if not overwrite:
            raise DataError(f"cannot resume the unfinished conversion in {partial}: {reason}; "
                            f"pass --force to start over")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    state = _Progress(signature)
    state.save(partial)
    return state


def _convert_one(path: Path, entry: ListEntry, index: int, opts: ImagesetOptions,
                 out: list[Any]) -> None:
    """A decoder's job: the entry's record, or the reason it cannot be made."""
    try:
        datum, shape = image_datum(path, entry.label, opts)
    except DataError as e:
        out[index] = str(e)
    else:
        out[index] = (datum.SerializeToString(), shape)


def convert_imageset(list_file: Path, out: Path, root: Path | None = None,
                     opts: ImagesetOptions = ImagesetOptions(), overwrite: bool = False,
                     on_record: OnRecord | None = None, on_skip: OnSkip | None = None,
                     decoders: int = 0) -> tuple[int, int]:
    """Write the LMDB ``out`` from ``list_file``; returns (records written, images skipped).

    ``decoders`` threads (0: default_decoders) read, decode, resize and encode the images;
    the records are written in list order. ``on_record(done, total)`` follows the progress
    (from where a resumed conversion starts); ``on_skip(entry, reason)`` hears of each bad
    image skipped (with ``opts.strict`` the first one raises a DataError and nothing is kept).

    The records go to ``partial_path(out)`` with a progress file, committed every
    CHECKPOINT_S seconds; KeyboardInterrupt commits what is done and raises Interrupted, and
    the same call later continues from there (a record made twice is the same record under
    the same key). Only a finished database is moved to ``out``.
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
    partial = partial_path(out)
    state = _resume(partial, _signature(list_file, root, opts), overwrite)
    pool = DecoderPool(max(0, decoders or default_decoders()), name="data images")
    env = open_lmdb_writer(partial)
    keep = False
    try:
        try:
            _write(entries, root, opts, state, env, pool, partial, on_record, on_skip,
                   str(list_file))
        except KeyboardInterrupt:
            keep = True
            raise Interrupted(state.next, len(entries), partial) from None
        finally:
            env.close()
            # the jobs not started are cancelled; one blocked on a file (a stalled network
            # mount) is left to end with the process (a daemon thread)
            pool.close(timeout=5.0)
        if state.written == 0:
            raise DataError(f"{list_file}: none of its {len(entries)} images could be read")
        (partial / PROGRESS).unlink()
        if out.exists():  # an LMDB folder, or an empty one (checked above)
            for name in _LMDB_FILES:
                (out / name).unlink(missing_ok=True)
            out.rmdir()
        os.replace(partial, out)
    finally:
        if not keep:
            shutil.rmtree(partial, ignore_errors=True)
    return state.written, state.skipped


def _write(entries: list[ListEntry], root: Path | None, opts: ImagesetOptions,
           state: _Progress, env: Any, pool: DecoderPool, partial: Path,
           on_record: OnRecord | None, on_skip: OnSkip | None, where: str) -> None:
    """Make and write the records from ``state.next`` on, checkpointing ``state``."""
    import lmdb
    total = len(entries)
    paths = [Path(root) / e.name if root is not None else Path(e.name) for e in entries]
    results: list[Any] = [None] * total

    def submit(start: int) -> Pending | None:
        if start >= total:
            return None
        return pool.run([functools.partial(_convert_one, paths[i], entries[i], i, opts, results)
                         for i in range(start, min(start + CHUNK, total))])

    if on_record is not None:
        on_record(state.next, total)
    txn = env.begin(write=True)
    last_checkpoint = time.monotonic()
    chunk, ahead = None, submit(state.next)  # the decoders work a chunk ahead of the writing
    try:
        while ahead is not None:
            chunk, start = ahead, state.next
            ahead = submit(start + CHUNK)
            chunk.wait()
            for i in range(start, min(start + CHUNK, total)):
                result, results[i] = results[i], None
                if isinstance(result, tuple) and opts.check_size:
                    state.first_shape = state.first_shape or list(result[1])
                    if list(result[1]) != state.first_shape:
                        result = (f"{paths[i]}: shape {tuple(result[1])} differs from the first "
                                  f"image's {tuple(state.first_shape)} (check_size)")
                if isinstance(result, str):
                    if opts.strict:
                        raise DataError(f"{where}:{entries[i].line}: {result}")
                    state.skipped += 1
                    if on_skip is not None:
                        on_skip(entries[i], result)
                else:
                    txn.put(f"{i:08d}_{entries[i].name}".encode(), result[0])
                    state.written += 1
                state.next = i + 1
                if on_record is not None:
                    on_record(i + 1, total)
            if time.monotonic() - last_checkpoint > CHECKPOINT_S or ahead is None:
                txn = _checkpoint(txn, env, state, partial)
                last_checkpoint = time.monotonic()
    except KeyboardInterrupt:
        try:
            _checkpoint(txn, env, state, partial, again=False)
        except lmdb.Error:  # interrupted inside a checkpoint, after its commit
            state.save(partial)
        raise
    finally:
        for pending in (chunk, ahead):
            if pending is not None:
                pending.cancel()
    txn.abort()


def _checkpoint(txn: Any, env: Any, state: _Progress, partial: Path, again: bool = True) -> Any:
    """Commit the records, put them on disk, then record the progress; a new transaction."""
    txn.commit()
    env.sync(True)
    state.save(partial)
    return env.begin(write=True) if again else None
