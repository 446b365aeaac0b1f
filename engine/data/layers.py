"""Caffe's data layers: Data (LMDB/LevelDB), ImageData, HDF5Data, MemoryData, WindowData;
and HDF5Output, the layer that writes two blobs to an HDF5 file.

Every layer here reads an endless *stream* of records: record ``k`` of the stream is record
``k mod N`` of the source (Caffe starts again at the first record when it reaches the end).
A batch is a pure function of the stream index it starts at, which gives three things:

- **Distribution (block striding).** In TRAIN, worker ``r`` of ``P`` (``self.context``) with
  batch ``B`` reads, for the batch that starts at stream index ``pos``, the records
  ``pos + r*B ... pos + r*B + B-1``, and every worker then moves on to ``pos + P*B``. The
  union of the ``P`` workers' i-th batches, in rank order, is exactly the i-th batch of one
  worker with batch ``P*B``: P workers with batch B train on what one worker with batch P*B
  would. (Caffe 1.0's multi-GPU reader interleaves single records instead, which does not
  have this property.) TEST nets are not strided: every worker reads the whole stream, as
  Caffe does. With ``data_param { shared_file_system: false }`` set explicitly and more than
  one worker, worker ``r`` reads its own database ``source + "_" + r`` (Poseidon's
  ``source_k``) from its start; unset, the workers share ``source`` (striding).
- **Exact resume.** ``position()`` is the stream index of the next batch (the same number on
  every worker, in single-worker record units); ``seek(position)`` continues from there.
  The solver stores it in the solverstate.
- **Deterministic prefetch and decoding.** The prefetch thread computes the same pure
  function ahead of time, in order (engine.data.prefetch), and the decoding threads each
  fill rows of it (engine.data.decoders). Random crops and mirrors take words hashed from
  (a seed drawn once from ``engine.backend.rng()`` at set-up, the stream index)
  (engine.data.transformer.crop_draws); shuffles and windows draw from a Generator seeded
  by the same pair; never from a shared stream, so they do not depend on threads, decoders,
  workers or restarts.

``rand_skip`` (Data, ImageData) starts the stream at a random index below ``rand_skip``, as
older Caffe did (Caffe 1.0's Data layer ignores the field).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .. import backend, glog
from ..pb import caffe_pb2
from ..blob import Blob
from ..caffe_io.files import atomic_path, import_h5py
from ..layers.base import Layer, register
from .datum import (DataError, datum_image, datum_is_encoded, decode_image, load_image,
                    resize_bilinear)
from .decoders import DecodeStats, DecoderPool, Pending, default_decoders
from .imageset import ListEntry, read_image_list
from .lmdb_source import DBSource, SourceNotFound, open_db
from .prefetch import Prefetcher
from .transformer import DataTransformer, crop_draws, read_mean_file

#: LMDB folder name fragment -> the `poseidon data` subcommand that writes it
_MAKERS = (("fashion", "fashion-mnist"), ("mnist", "mnist"), ("cifar", "cifar10"),
           ("digits", "digits"))


def _how_to_make(path: Path) -> str:
    name = path.name.lower()
    for fragment, command in _MAKERS:
        if fragment in name:
            return f"make it with `poseidon data {command} --out {path.parent}`"
    return ("make it with `poseidon data mnist|cifar10|fashion-mnist|digits --out DIR`, "
            "or Caffe's convert_imageset")


class _Batch:
    """One batch being filled by decoding jobs, each writing its own rows (engine.data.decoders)."""

    def __init__(self, data: np.ndarray, labels: np.ndarray):
        self.data, self.labels = data, labels
        #: rows whose image transforms to another shape than ``data``'s: (row, array)
        self.odd: dict[int, np.ndarray] = {}
        #: rows whose record could not be read: (row, record, its random words, reason)
        self.failed: list[tuple[int, Any, Any, str]] = []
        #: (decode, transform) seconds of each image
        self.times: list[tuple[float, float]] = []
        self.pending: Pending | None = None


def _cancel(batch: Any) -> None:
    """A prefetched batch thrown away: its jobs not yet started are skipped."""
    if isinstance(batch, _Batch) and batch.pending is not None:
        batch.pending.cancel()


class StreamDataLayer(Layer):
    """Base of the data layers: batches by stream index, striding, position/seek, prefetch.

    A subclass's ``setup`` calls ``_init_stream`` and implements ``_load(pos)``, which returns
    the tops' arrays (NumPy) for the batch starting at stream index ``pos``, or a ``_Batch``
    whose decoding jobs are under way (``_complete`` waits for them in the consumer's thread).
    """

    exact_num_bottoms = 0
    min_tops = 1
    batch_size: int = 0
    _prefetch_depth: int = 0
    _prefetcher: Prefetcher | None = None
    _pool: DecoderPool | None = None

    @contextlib.contextmanager
    def _named_errors(self) -> Iterator[None]:
        """Turn a DataError from the helpers into an error that names this layer."""
        try:
            yield
        except DataError as e:
            raise self.fail(str(e)) from None

    def _init_stream(self, batch_size: int, start: int, strided: bool, prefetch: int) -> None:
        if batch_size <= 0:
            raise self.fail("batch_size must be positive")
        self.batch_size = batch_size
        striding = strided and self.phase == "TRAIN" and self.context.world_size > 1
        self._rank = self.context.rank if striding else 0
        self._world = self.context.world_size if striding else 1
        self._pos = int(start)
        # the thread starts with the first batch, so set-up may still read the source itself
        self._prefetch_depth = prefetch
        self.stats = DecodeStats()

    def _init_decoders(self, decodes: bool = True) -> None:
        """The decoding threads, as many as data_param.decoders says; by default
        default_decoders() when the records are images to decode, one when they are raw
        pixels (their transform is bound by memory traffic: on the 2-core VM two threads
        took 31.6 ms a batch where one took 27.7, ``poseidon bench data``)."""
        n = int(self.param.data_param.decoders) or (default_decoders() if decodes else 1)
        self.decoders = n
        # one decoder runs the jobs in the prefetch thread itself: no hand-over
        self._pool = DecoderPool(n if n > 1 else 0, name=f"decode '{self.name}'")

    def _draw_seed(self) -> int:
        """The seed of this layer's per-record random draws, from the run's random stream."""
        return int(backend.rng().integers(2 ** 63))

    @property
    def step(self) -> int:
        """How far the stream moves per batch: B, or P*B when this worker reads one block of P."""
        return self.batch_size * self._world

    def record_indices(self, pos: int) -> np.ndarray:
        """Stream indices of the records of this worker's batch that starts at ``pos``."""
        return pos + self._rank * self.batch_size + np.arange(self.batch_size, dtype=np.int64)

    def position(self) -> int:
        """Stream index of the next batch to read (single-worker record units)."""
        return self._pos

    def seek(self, position: int) -> None:
        """Continue from stream index ``position``; batches prefetched before are dropped."""
        self._pos = int(position)
        if self._prefetcher is not None:
            self._prefetcher.reset(self._pos)

    def next_batch(self) -> tuple[np.ndarray, ...]:
        """The arrays of the batch at ``position()``; advances the position."""
        start = time.perf_counter()
        if self._prefetch_depth > 0:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self._load, self._pos, self.step,
                                              self._prefetch_depth, name=f"prefetch '{self.name}'",
                                              discard=_cancel)
            _, loaded = self._prefetcher.get()
        else:
            loaded = self._load(self._pos)
        batch = self._complete(loaded) if isinstance(loaded, _Batch) else loaded
        self.stats.wait_s += time.perf_counter() - start
        self._pos += self.step
        return batch

    def _load(self, pos: int) -> "tuple[np.ndarray, ...] | _Batch":
        raise NotImplementedError

    def _complete(self, batch: _Batch) -> tuple[np.ndarray, ...]:
        """The arrays of a batch once its jobs have run (in the consumer's thread)."""
        batch.pending.wait()
        stats = self.stats
        stats.batches += 1
        stats.records += len(batch.labels)
        for decode_s, transform_s in batch.times:
            stats.decode_s += decode_s
            stats.transform_s += transform_s
        return batch.data, batch.labels

    def _shape_tops(self, top: Sequence[Blob], shapes: Sequence[tuple[int, ...]]) -> None:
        for blob, shape in zip(top, shapes):
            blob.reshape(shape)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Tops keep the shape of the last batch (set at set-up from the first record)."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._copy_tops(top, self.next_batch())

    @staticmethod
    def _copy_tops(top: Sequence[Blob], batch: tuple[np.ndarray, ...]) -> None:
        for blob, array in zip(top, batch):
            blob.reshape(array.shape)
            xp = backend.get_array_module(blob.data)
            blob.data[...] = xp.asarray(array)

    def close(self) -> None:
        """Stop the prefetch thread and the decoders, and release the source."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class _Record(NamedTuple):
    """One item of a source as the prefetch thread read it."""

    stream: int  # stream index
    index: int  # position in the source (the stream index modulo its size)
    key: Any  # a database key, an image path
    value: Any  # the serialized Datum, the label


class _ImageStreamLayer(StreamDataLayer):
    """Shared by Data and ImageData: images through a DataTransformer, optional labels.

    The prefetch thread reads a batch's records in stream order (``_fetch``); the decoders
    decode each one (``_decode``) and transform it into its row of the batch. A record that
    cannot be read is named, by its key and its stream position, and stops the run with
    data_param.strict; otherwise the next readable record of the source (``_following``)
    takes its row, keeping the row's stream index for the random crop and mirror: a batch
    stays a function of its position.
    """

    max_tops = 2

    def _init_transformer(self) -> None:
        tp = self.param.transform_param
        mean = self.context.resolve(tp.mean_file) if tp.HasField("mean_file") else None
        with self._named_errors():
            self.transformer = DataTransformer(tp, self.phase, mean, where="transform_param")
        self._seed = self._draw_seed() if self.transformer.random else 0
        self.strict = bool(self.param.data_param.strict)
        self._free: list[np.ndarray] = []
        self._warned: set[Any] = set()

    # the source: subclasses
    def _fetch(self, k: int) -> _Record:
        """The record at stream index ``k``; called in stream order from one thread."""
        raise NotImplementedError

    def _decode(self, record: _Record) -> tuple[np.ndarray, int]:
        """(CHW pixels, label) of a record; any thread; a DataError when it cannot be read."""
        raise NotImplementedError

    def _following(self, record: _Record) -> _Record:
        """The record after ``record`` in the source (called from the consumer's thread)."""
        raise NotImplementedError

    def _describe(self, record: _Record) -> str:
        raise NotImplementedError

    def _source_size(self) -> int:
        raise NotImplementedError

    def _decodes(self, record: _Record) -> bool:
        """Whether this source's records are images to decode (the first one says)."""
        return True

    def _setup_image_tops(self, top: Sequence[Blob]) -> None:
        k = int(self.record_indices(self._pos)[0])
        record = self._fetch(k)
        self._init_decoders(self._decodes(record))
        first, _ = self._readable(record, None)
        with self._named_errors():
            shape = self.transformer.output_shape(first.shape)
        self._shape_tops(top, [(self.batch_size, *shape), (self.batch_size,)])
        self._row_shape = shape

    def _readable(self, record: _Record, reason: str | None) -> tuple[np.ndarray, int]:
        """The pixels and label for ``record``'s row: its own, or (it cannot be read; with
        ``reason``, that is known already) those of the next readable record."""
        if reason is None:
            try:
                return self._decode(record)
            except DataError as e:
                reason = str(e)
        where = self._describe(record)
        if self.strict:
            raise self.fail(f"{where}: {reason} (data_param.strict)")
        if record.key not in self._warned:
            self._warned.add(record.key)
            glog.warning(f"layer '{self.name}': skipping {where}: {reason}; the next readable "
                         f"record takes its place")
        other = record
        for _ in range(self._source_size() - 1):
            other = self._following(other)
            try:
                image, label = self._decode(other)
            except DataError:
                continue
            self.stats.skipped += 1
            return image, label
        raise self.fail(f"{where}: {reason}; and no other record of {self.source} can be "
                        f"read either")

    def _load(self, pos: int) -> _Batch:
        start = time.perf_counter()
        indices = [int(k) for k in self.record_indices(pos)]
        records = [self._fetch(k) for k in indices]
        self.stats.read_s += time.perf_counter() - start
        data = self._free.pop() if self._free else np.empty((self.batch_size, *self._row_shape),
                                                             dtype=np.float32)
        batch = _Batch(data, np.empty(self.batch_size, dtype=np.float32))
        draws = self._draws(indices)
        batch.pending = self._pool.run([functools.partial(self._fill, batch, row, record, draw)
                                        for row, (record, draw) in enumerate(zip(records, draws))])
        return batch

    def _draws(self, indices: list[int]) -> list[tuple[int, int, int] | None]:
        """Each row's random words (crop_draws): a function of its stream index."""
        if not self.transformer.random:
            return [None] * len(indices)
        return [tuple(row) for row in crop_draws(self._seed, np.asarray(indices)).tolist()]

    def _fill(self, batch: _Batch, row: int, record: _Record,
              draw: tuple[int, int, int] | None) -> None:
        """One decoding job: the record's image, transformed into its row."""
        start = time.perf_counter()
        try:
            image, label = self._decode(record)
        except DataError as e:
            batch.failed.append((row, record, draw, str(e)))
            return
        decoded = time.perf_counter()
        self._place(batch, row, draw, image, label)
        batch.times.append((decoded - start, time.perf_counter() - decoded))

    def _place(self, batch: _Batch, row: int, draw: tuple[int, int, int] | None,
               image: np.ndarray, label: int) -> None:
        with self._named_errors():
            shape = self.transformer.output_shape(image.shape)
        out = (batch.data[row] if shape == batch.data.shape[1:]
               else batch.odd.setdefault(row, np.empty(shape, dtype=np.float32)))
        self.transformer.transform_into(image, out, draw)
        batch.labels[row] = label

    def _complete(self, batch: _Batch) -> tuple[np.ndarray, ...]:
        batch.pending.wait()
        for row, record, draw, reason in sorted(batch.failed, key=lambda f: f[0]):
            image, label = self._readable(record, reason)
            self._place(batch, row, draw, image, label)
        data, labels = super()._complete(batch)
        if batch.odd:
            shapes = {a.shape for a in batch.odd.values()}
            if len(batch.odd) < len(labels) or len(shapes) > 1:
                raise self.fail(f"images of different shapes in one batch "
                                f"({sorted(shapes | {data.shape[1:]})}); set batch_size 1 or "
                                f"resize them")
            self._free.append(data)
            data = np.stack([batch.odd[i] for i in range(len(labels))])
        return data, labels

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        data, labels = batch = self.next_batch()
        blob = top[0]
        if type(blob.data) is not np.ndarray or blob.data.dtype != data.dtype:
            self._copy_tops(top, batch)  # a GPU or float64 blob: copy into it
            del batch
            self._recycle(data)
            return
        # Hand the batch's array to the blob instead of copying it (79 MB for AlexNet's b128,
        # a core's worth of memory traffic beside the decoders), as Caffe's prefetching layer
        # does (set_cpu_data); layers that view the blob re-view it every pass (Reshape).
        blob.reshape(data.shape)
        old, blob.data = blob.data, data
        self._recycle(old)
        if len(top) > 1:
            top[1].reshape(labels.shape)
            top[1].data[...] = labels

    def _recycle(self, array: np.ndarray) -> None:
        # A fresh batch array would be new pages, faulted in and zeroed by the kernel on every
        # batch: more than the transform itself. An array is reused only when nothing else
        # holds it (a view of it, a pycaffe user's reference): refcount = ours + the call's.
        if (array.shape[1:] == self._row_shape and len(self._free) < 2
                and sys.getrefcount(array) <= 3):
            self._free.append(array)


@register("Data", "DATA")
class DataLayer(_ImageStreamLayer):
    """Caffe's Data layer: Datum records from an LMDB (or LevelDB) in key order."""

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        dp = self.param.data_param
        backend_name = caffe_pb2.DataParameter.DB.Name(dp.backend)
        ctx = self.context
        own_files = (ctx.world_size > 1 and dp.HasField("shared_file_system")
                     and not dp.shared_file_system)
        source = f"{dp.source}_{ctx.rank}" if own_files else dp.source
        if not source:
            raise self.fail("data_param.source is not set")
        self.source = ctx.resolve(source)
        self._backend = backend_name
        with self._named_errors():
            try:
                # records are decoded before the source closes (close() stops the decoders
                # first), so they can be views of its pages
                self._db: DBSource = open_db(self.source, backend_name, zero_copy=True)
            except SourceNotFound:
                shown = Path(os.path.normpath(self.source))
                raise DataError(f"{backend_name} not found: {shown} "
                                f"({_how_to_make(shown)})") from None
        self._spare: DBSource | None = None
        self._init_transformer()
        skip = int(backend.rng().integers(dp.rand_skip)) if dp.rand_skip else 0
        self._init_stream(dp.batch_size, skip, strided=not own_files, prefetch=dp.prefetch)
        self._setup_image_tops(top)

    def _fetch(self, k: int) -> _Record:
        key, value = self._db.get(k)
        return _Record(k, k % len(self._db), key, value)

    def _decode(self, record: _Record) -> tuple[np.ndarray, int]:
        return datum_image(record.value, self.transformer.color)

    def _decodes(self, record: _Record) -> bool:
        try:
            return datum_is_encoded(record.value)
        except DataError:  # a corrupt first record: named when it is read
            return True

    def _following(self, record: _Record) -> _Record:
        if self._spare is None:  # the prefetch thread has the main cursor
            self._spare = open_db(self.source, self._backend)
        key, value = self._spare.following(record.key)
        return _Record(record.stream + 1, (record.index + 1) % len(self._db), key, value)

    def _describe(self, record: _Record) -> str:
        return (f"corrupt record {record.index} (key {record.key!r}, stream position "
                f"{record.stream}) in {self.source}")

    def _source_size(self) -> int:
        return len(self._db)

    def close(self) -> None:
        super().close()
        self._db.close()
        if self._spare is not None:
            self._spare.close()


@register("ImageData", "IMAGE_DATA")
class ImageDataLayer(_ImageStreamLayer):
    """Caffe's ImageData layer: a list file of ``<path> <label>`` lines, images read from disk.

    Images are read like cv::imread (BGR, or grey when ``is_color: false``) and resized with
    OpenCV's bilinear rule when new_height/new_width are set. ``shuffle`` reorders the list
    every pass (a permutation per pass, drawn from the layer's seed and the pass number).
    """

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        ip = self.param.image_data_param
        if (ip.new_height > 0) != (ip.new_width > 0):
            raise self.fail("new_height and new_width must be set together")
        if not ip.source:
            raise self.fail("image_data_param.source is not set")
        self.source = self.context.resolve(ip.source)
        self.lines = self._read_list(self.source)
        self._init_transformer()
        self._shuffle_seed = self._draw_seed() if ip.shuffle else 0
        self._perm: tuple[int, np.ndarray] = (-1, np.arange(0))
        skip = int(backend.rng().integers(ip.rand_skip)) if ip.rand_skip else 0
        # Caffe's prefetching layers all take their queue depth from data_param.prefetch
        self._init_stream(ip.batch_size, skip, strided=True,
                          prefetch=self.param.data_param.prefetch)
        self._setup_image_tops(top)

    def _read_list(self, path: Path) -> list[ListEntry]:
        with self._named_errors():
            return read_image_list(path)

    def _fetch(self, k: int) -> _Record:
        epoch, j = divmod(k, len(self.lines))
        if self._shuffle_seed:
            # one tuple, replaced whole: the consumer's thread may read it too (_following)
            cached_epoch, perm = self._perm
            if cached_epoch != epoch:
                perm = np.random.default_rng([self._shuffle_seed, epoch]).permutation(
                    len(self.lines))
                self._perm = (epoch, perm)
            j = int(perm[j])
        entry = self.lines[j]
        return _Record(k, j, entry, entry.label)

    def _decode(self, record: _Record) -> tuple[np.ndarray, int]:
        ip = self.param.image_data_param
        # Caffe concatenates root_folder and the listed name as strings
        path = self.context.resolve(ip.root_folder + record.key.name)
        return load_image(path, ip.is_color, ip.new_height, ip.new_width), record.value

    def _following(self, record: _Record) -> _Record:
        return self._fetch(record.stream + 1)

    def _describe(self, record: _Record) -> str:
        return (f"image {record.key.name} ({self.source}:{record.key.line}, stream position "
                f"{record.stream})")

    def _source_size(self) -> int:
        return len(self.lines)


@register("HDF5Data", "HDF5_DATA")
class HDF5DataLayer(StreamDataLayer):
    """Caffe's HDF5Data layer: each top is the dataset of that name in the listed .h5 files.

    The stream is the files' rows in list order; with ``shuffle`` every pass takes the files
    in a new order and each file's rows in a new order. No transformation is applied (as in
    Caffe). Files are loaded whole, one at a time.
    """

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        hp = self.param.hdf5_data_param
        if not hp.source:
            raise self.fail("hdf5_data_param.source is not set")
        self.source = self.context.resolve(hp.source)
        self.files = self._read_list(self.source)
        self.names = list(self.param.top)
        if len(self.names) < len(top):
            raise self.fail("every top must be named (the names are the HDF5 dataset names)")
        self.rows = np.array([self._rows(f) for f in self.files], dtype=np.int64)
        self.total = int(self.rows.sum())
        if self.total == 0:
            raise self.fail(f"the files of {self.source} hold no rows")
        self._shuffle_seed = self._draw_seed() if hp.shuffle else 0
        self._cached: tuple[int, list[np.ndarray]] = (-1, [])
        self._perms: dict[tuple[int, ...], np.ndarray] = {}
        self._init_stream(hp.batch_size, 0, strided=True, prefetch=0)
        first = self._file(0)
        self._shape_tops(top, [(self.batch_size, *a.shape[1:]) for a in first])

    def _read_list(self, path: Path) -> list[Path]:
        try:
            lines = [ln.strip() for ln in path.read_text().splitlines()]
        except OSError as e:
            raise self.fail(f"cannot read HDF5 list {path}: {e.strerror}") from None
        files = []
        for n, line in enumerate(lines, 1):
            if not line:
                continue
            beside = path.parent / line
            f = beside if beside.exists() else self.context.resolve(line)
            if not f.is_file():
                raise self.fail(f"{path}:{n}: HDF5 file not found: {line}")
            files.append(f)
        if not files:
            raise self.fail(f"HDF5 list {path} names no files")
        return files

    def _rows(self, path: Path) -> int:
        import h5py
        try:
            with h5py.File(path, "r") as h5:
                counts = set()
                for name in self.names:
                    if name not in h5:
                        raise self.fail(f"{path} has no dataset '{name}' (one per top)")
                    counts.add(h5[name].shape[0] if h5[name].ndim else 0)
        except OSError as e:
            raise self.fail(f"cannot read HDF5 file {path}: {e}") from None
        if len(counts) != 1:
            raise self.fail(f"{path}: datasets {self.names} have different numbers of rows")
        return counts.pop()

    def _file(self, f: int) -> list[np.ndarray]:
        import h5py
        if self._cached[0] != f:
            with h5py.File(self.files[f], "r") as h5:
                self._cached = (f, [np.asarray(h5[name][...]) for name in self.names])
        return self._cached[1]

    def _permutation(self, key: tuple[int, ...], n: int) -> np.ndarray:
        """The shuffle of ``n`` items for ``key`` (pass, or pass and file); the last few kept."""
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) > 8:
                self._perms.clear()
            rng = np.random.default_rng([self._shuffle_seed, *key])
            perm = self._perms[key] = rng.permutation(n)
        return perm

    def _locate(self, k: int) -> tuple[int, int]:
        """(file, row) of stream index ``k``."""
        epoch, j = divmod(k, self.total)
        order = (self._permutation((epoch,), len(self.files)) if self._shuffle_seed
                 else np.arange(len(self.files)))
        ends = np.cumsum(self.rows[order])
        t = int(np.searchsorted(ends, j, side="right"))
        f = int(order[t])
        row = j - (int(ends[t - 1]) if t else 0)
        if self._shuffle_seed:
            row = int(self._permutation((epoch, f), int(self.rows[f]))[row])
        return f, row

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        rows: list[list[np.ndarray]] = [[] for _ in self.names]
        for k in self.record_indices(pos):
            f, row = self._locate(int(k))
            for out, array in zip(rows, self._file(f)):
                out.append(array[row])
        return tuple(np.stack(r) for r in rows)


@register("MemoryData", "MEMORY_DATA")
class MemoryDataLayer(StreamDataLayer):
    """Caffe's MemoryData layer, fed from Python with ``reset(data, labels)`` (pycaffe's
    ``net.set_input_arrays``). Arrays are used as given (no transformation), batches go
    through them in order and wrap around."""

    max_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        mp = self.param.memory_data_param
        self.item_shape = (mp.channels, mp.height, mp.width)
        if min(self.item_shape) <= 0:
            raise self.fail("memory_data_param needs positive channels, height and width")
        self._data: np.ndarray | None = None
        self._labels = np.zeros(0, dtype=np.float32)
        self._init_stream(mp.batch_size, 0, strided=True, prefetch=0)
        self._shape_tops(top, [(self.batch_size, *self.item_shape), (self.batch_size,)])

    def reset(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Use ``data`` (N, C, H, W) and ``labels`` (N,) or (N, 1, 1, 1) from the next batch on."""
        data = np.asarray(data)
        labels = np.asarray(labels).reshape(-1)
        if data.ndim != 4 or data.shape[1:] != self.item_shape:
            raise self.fail(f"data of shape {data.shape} does not match (N, {self.item_shape[0]}, "
                            f"{self.item_shape[1]}, {self.item_shape[2]})")
        if labels.shape[0] != data.shape[0]:
            raise self.fail(f"{data.shape[0]} images but {labels.shape[0]} labels")
        if data.shape[0] == 0 or data.shape[0] % self.batch_size:
            raise self.fail(f"the number of images ({data.shape[0]}) must be a positive multiple "
                            f"of batch_size ({self.batch_size})")
        self._data, self._labels = data, labels.astype(np.float32)
        self.seek(0)

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        if self._data is None:
            raise self.fail("no data: call reset(data, labels) first (pycaffe's set_input_arrays)")
        idx = self.record_indices(pos) % self._data.shape[0]
        return self._data[idx], self._labels[idx]


# -- WindowData ---------------------------------------------------------------------------------

class WindowImage(NamedTuple):
    """One image record of a window file; ``windows`` rows are (class, overlap, x1, y1, x2, y2,
    line), coordinates inclusive and 0-based as Caffe reads them."""
    name: str
    channels: int
    height: int
    width: int
    windows: list[tuple[int, float, int, int, int, int, int]]


def _tokens(text: str) -> Iterator[tuple[str, int]]:
    for n, line in enumerate(text.splitlines(), 1):
        for token in line.split():
            yield token, n


def read_window_file(path: Path) -> list[WindowImage]:
    """Parse Caffe's window file (R-CNN's format), one image record after another::

        # <image index>
        <image path>
        <channels>
        <height>
        <width>
        <number of windows>
        <class> <overlap> <x1> <y1> <x2> <y2>     (one line per window)

    Like Caffe's stream reader, any whitespace separates the fields (image paths cannot hold
    spaces). Caffe uses the image index to look the image up by file order, so the indices
    must run 0, 1, 2, ...; anything else is reported as an error rather than read as the wrong
    picture. Errors are one DataError naming the file and line.
    """
    try:
        text = path.read_text()
    except OSError as e:
        raise DataError(f"cannot read window file {path}: {e.strerror}") from None
    tokens = _tokens(text)
    last_line = max(1, len(text.splitlines()))

    def take(what: str, kind: Callable[[str], Any] = str, check: str = "") -> tuple[Any, int]:
        try:
            token, n = next(tokens)
        except StopIteration:
            raise DataError(f"{path}:{last_line}: unexpected end of file, "
                            f"expected {what}") from None
        try:
            value = kind(token)
        except ValueError:
            raise DataError(f"{path}:{n}: expected {what}, got {token!r}") from None
        if (check == "positive" and value <= 0) or (check == "non-negative" and value < 0):
            raise DataError(f"{path}:{n}: {what} must be {check}, got {token!r}")
        return value, n

    images: list[WindowImage] = []
    while True:
        try:
            tag, n = next(tokens)
        except StopIteration:
            break
        if tag != "#":
            raise DataError(f"{path}:{n}: expected '# <image index>' to start image record "
                            f"{len(images)}, got {tag!r}")
        index, n = take("the image index after '#'", int)
        if index != len(images):
            raise DataError(f"{path}:{n}: image index {index} out of sequence, expected "
                            f"{len(images)} (Caffe finds an image by its index in file order)")
        name, _ = take("the image path")
        channels, n = take("the number of channels", int, "positive")
        if channels not in (1, 3):
            raise DataError(f"{path}:{n}: images must have 1 or 3 channels, got {channels}")
        height, _ = take("the image height", int, "positive")
        width, _ = take("the image width", int, "positive")
        count, _ = take("the number of windows", int, "non-negative")
        windows = []
        for _ in range(count):
            what = "a window line '<class> <overlap> <x1> <y1> <x2> <y2>'"
            label, n = take(what, int)
            overlap, _ = take(what, float)
            x1, _ = take(what, int)
            y1, _ = take(what, int)
            x2, _ = take(what, int)
            y2, n2 = take(what, int)
            if x2 < x1 or y2 < y1:
                raise DataError(f"{path}:{n2}: window ({x1}, {y1}, {x2}, {y2}) has x2 < x1 or "
                                f"y2 < y1 (corners are inclusive: x1 y1 x2 y2)")
            windows.append((label, overlap, x1, y1, x2, y2, n))
        images.append(WindowImage(name, channels, height, width, windows))
    if not images:
        raise DataError(f"window file {path} is empty")
    return images


def _c_round(value: np.float32) -> int:
    """C's round(): halves away from zero (NumPy's round goes to even). Exact: a float32
    plus 0.5 is representable in float64."""
    x = float(value)
    return int(math.copysign(math.floor(abs(x) + 0.5), x))


class WarpBox(NamedTuple):
    """Where one window comes from and where its warped pixels land in the crop."""
    x1: int  # source region in the image, inclusive
    y1: int
    x2: int
    y2: int
    out_h: int  # size the region is warped to
    out_w: int
    pad_h: int  # offset of the warped region in the crop_size x crop_size output
    pad_w: int


def warp_box(box: tuple[int, int, int, int], image_hw: tuple[int, int], crop: int,
             context_pad: int, square: bool, mirror: bool) -> WarpBox:
    """Caffe's window geometry (window_data_layer.cpp): with context padding or square mode
    the box is grown about its centre so that, warped to ``crop``, ``context_pad`` pixels of
    context surround it; the grown box is clipped to the image and the clipped part keeps the
    scale of the unclipped one, so the crop is zero where the box left the image.

    The arithmetic is float32 with C rounding, as in Caffe's float nets, so crops match pixel
    for pixel. Raises DataError when no part of the box lies in the image.
    """
    x1, y1, x2, y2 = box
    img_h, img_w = image_hw
    if not (context_pad > 0 or square):
        if x1 < 0 or y1 < 0 or x2 >= img_w or y2 >= img_h:
            raise DataError(f"window ({x1}, {y1}, {x2}, {y2}) does not fit in the "
                            f"{img_w}x{img_h} (width x height) image")
        return WarpBox(x1, y1, x2, y2, crop, crop, 0, 0)
    f32 = np.float32
    context_scale = f32(crop) / f32(crop - 2 * context_pad)
    half_h, half_w = f32((y2 - y1 + 1) / 2.0), f32((x2 - x1 + 1) / 2.0)
    centre_x, centre_y = f32(x1) + half_w, f32(y1) + half_h
    if square:
        half_h = half_w = max(half_h, half_w)
    x1 = _c_round(centre_x - half_w * context_scale)
    x2 = _c_round(centre_x + half_w * context_scale)
    y1 = _c_round(centre_y - half_h * context_scale)
    y2 = _c_round(centre_y + half_h * context_scale)
    unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
    pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
    pad_x2, pad_y2 = max(0, x2 - img_w + 1), max(0, y2 - img_h + 1)
    x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
    if x1 > x2 or y1 > y2:
        raise DataError(f"window ({box[0]}, {box[1]}, {box[2]}, {box[3]}) lies outside the "
                        f"{img_w}x{img_h} (width x height) image")
    scale_x, scale_y = f32(crop) / f32(unclipped_w), f32(crop) / f32(unclipped_h)
    out_w = _c_round(f32(x2 - x1 + 1) * scale_x)
    out_h = _c_round(f32(y2 - y1 + 1) * scale_y)
    pad_h = _c_round(f32(pad_y1) * scale_y)
    # a mirrored crop is flipped after warping, so its left padding is the box's right one
    pad_w = _c_round(f32(pad_x2 if mirror else pad_x1) * scale_x)
    # rounding can push the warped region past the crop's edge
    out_h, out_w = min(out_h, crop - pad_h), min(out_w, crop - pad_w)
    return WarpBox(x1, y1, x2, y2, out_h, out_w, pad_h, pad_w)


@register("WindowData", "WINDOW_DATA")
class WindowDataLayer(StreamDataLayer):
    """Caffe's WindowData layer (R-CNN fine-tuning): each item is a window sampled from a
    window file, cut out of its image with optional context and warped to crop_size.

    Every batch holds ``B - int(B * fg_fraction)`` background windows (overlap below
    bg_threshold; label 0) followed by ``int(B * fg_fraction)`` foreground ones (overlap at
    least fg_threshold; their class), each drawn uniformly from its set, then mirrored at
    random when ``mirror`` is set; windows in between the thresholds are never used. Item
    ``k`` of the stream draws from a Generator seeded by (layer seed, k), so a batch is a
    pure function of its position (exact resume, prefetch) like the other data layers; as
    the foreground/background split is per batch, P workers with batch B do not see what one
    worker with batch P*B would, only different windows each.

    Pixels are ``(pixel - mean) * scale`` where the warped window lands; the context that
    falls outside the image stays 0. The mean is ``mean_value`` per channel, or the mean
    file's centre crop_size x crop_size square (Caffe offsets both axes by
    ``(mean_width - crop_size) // 2``). crop_size, mirror, scale and mean_file are read from
    transform_param or window_data_param (a V1 net's upgrade moves them to transform_param;
    Caffe reads ``scale`` from window_data_param only). Images are decoded with Pillow into
    BGR (or grey when the window file gives 1 channel) and warped with OpenCV's bilinear rule.
    """

    exact_num_tops = 2

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        wp = self.param.window_data_param
        if not wp.source:
            raise self.fail("window_data_param.source is not set")
        self.source = self.context.resolve(wp.source)
        with self._named_errors():
            images = read_window_file(self.source)
        channels = {im.channels for im in images}
        if len(channels) > 1:
            raise self.fail(f"{self.source}: images with different numbers of channels "
                            f"({sorted(channels)}); one batch holds one kind")
        self.channels = channels.pop()
        self.crop_size = int(self._setting("crop_size"))
        if self.crop_size <= 0:
            raise self.fail("crop_size must be set: every window is warped to "
                            "crop_size x crop_size")
        self.context_pad = int(wp.context_pad)
        if 2 * self.context_pad >= self.crop_size:
            raise self.fail(f"context_pad {self.context_pad} leaves no room for the window in "
                            f"crop_size {self.crop_size}")
        if wp.crop_mode not in ("warp", "square"):
            raise self.fail(f"crop_mode must be \"warp\" or \"square\", got {wp.crop_mode!r}")
        self.square = wp.crop_mode == "square"
        self.mirror = bool(self._setting("mirror"))
        self.scale = np.float32(self._setting("scale"))
        self.mean = self._mean()
        self.image_paths = [self.context.resolve(wp.root_folder + im.name) for im in images]
        self.fg, self.bg = self._split(images, np.float32(wp.fg_threshold),
                                       np.float32(wp.bg_threshold))
        self._init_stream(wp.batch_size, 0, strided=True, prefetch=self.param.data_param.prefetch)
        self._init_decoders()
        self.num_fg = int(np.float32(self.batch_size) * np.float32(wp.fg_fraction))
        self.num_bg = self.batch_size - self.num_fg
        for pool, n, kind, rule in ((self.fg, self.num_fg, "foreground", f"overlap >= "
                                     f"fg_threshold {wp.fg_threshold:g}"),
                                    (self.bg, self.num_bg, "background", f"overlap < "
                                     f"bg_threshold {wp.bg_threshold:g}")):
            if n and not len(pool):
                raise self.fail(f"{self.source} has no {kind} windows ({rule}) but each batch "
                                f"takes {n}")
        # Caffe keeps the files' bytes and decodes them per window; so do we
        self._cache: list[bytes] | None = (
            [self._read_bytes(i) for i in range(len(images))] if wp.cache_images else None)
        self._seed = self._draw_seed()
        self._shape_tops(top, [(self.batch_size, self.channels, self.crop_size, self.crop_size),
                               (self.batch_size,)])

    def _setting(self, field: str) -> float | bool | str:
        """A field that transform_param and window_data_param both have: whichever is set."""
        tp, wp = self.param.transform_param, self.param.window_data_param
        if tp.HasField(field) and wp.HasField(field) and getattr(tp, field) != getattr(wp, field):
            raise self.fail(f"transform_param.{field} and window_data_param.{field} differ; "
                            f"set one")
        return getattr(tp if tp.HasField(field) else wp, field)

    def _mean(self) -> np.ndarray | None:
        """The value to subtract at each output position, (C, crop, crop), or None."""
        c, crop = self.channels, self.crop_size
        values = np.asarray(self.param.transform_param.mean_value, dtype=np.float32)
        mean_file = self._setting("mean_file")
        if mean_file and len(values):
            raise self.fail("cannot specify mean_file and mean_value at the same time")
        if len(values):
            if len(values) not in (1, c):
                raise self.fail(f"specify either 1 mean_value or as many as channels ({c}), "
                                f"got {len(values)}")
            return np.ascontiguousarray(np.broadcast_to(
                np.broadcast_to(values, (c,)).reshape(c, 1, 1), (c, crop, crop)))
        if not mean_file:
            return None
        path = self.context.resolve(str(mean_file))
        with self._named_errors():
            mean = read_mean_file(path)
        off = (mean.shape[2] - crop) // 2
        if mean.shape[0] != c or off < 0 or off + crop > mean.shape[1]:
            raise self.fail(f"mean file {path} has shape {mean.shape}; WindowData needs "
                            f"({c}, H, W) with W >= crop_size {crop} and room for a "
                            f"{crop}x{crop} square at ({off}, {off})")
        return np.ascontiguousarray(mean[:, off:off + crop, off:off + crop])

    def _split(self, images: list[WindowImage], fg_threshold: np.float32,
               bg_threshold: np.float32) -> tuple[np.ndarray, np.ndarray]:
        """Foreground and background windows as rows (image, label, x1, y1, x2, y2, line)."""
        fg, bg = [], []
        for i, im in enumerate(images):
            for label, overlap, x1, y1, x2, y2, line in im.windows:
                overlap = np.float32(overlap)  # Caffe compares in float
                if overlap >= fg_threshold:
                    if label <= 0:
                        raise self.fail(f"{self.source}:{line}: a foreground window (overlap "
                                        f"{overlap:g} >= fg_threshold) needs a class > 0, "
                                        f"got {label}")
                    fg.append((i, label, x1, y1, x2, y2, line))
                elif overlap < bg_threshold:
                    bg.append((i, 0, x1, y1, x2, y2, line))
        return (np.array(fg, dtype=np.int64).reshape(-1, 7),
                np.array(bg, dtype=np.int64).reshape(-1, 7))

    def _read_bytes(self, image: int) -> bytes:
        path = self.image_paths[image]
        try:
            return path.read_bytes()
        except OSError as e:
            raise self.fail(f"cannot read image {path} (image {image} of {self.source}): "
                            f"{e.strerror}") from None

    def _image(self, image: int) -> np.ndarray:
        """The image as HWC uint8 (BGR, or one grey channel)."""
        data = self._cache[image] if self._cache is not None else self._read_bytes(image)
        try:
            return decode_image(data, color=self.channels == 3)
        except DataError as e:
            raise self.fail(f"{self.image_paths[image]}: {e}") from None

    def _load(self, pos: int) -> _Batch:
        crop = self.crop_size
        batch = _Batch(np.zeros((self.batch_size, self.channels, crop, crop), dtype=np.float32),
                       np.empty(self.batch_size, dtype=np.float32))
        # the draws are cheap and made here, in stream order; the jobs are the pictures, each
        # decoded once for all of its windows in the batch (they often share one)
        windows: dict[int, list[tuple[int, tuple[int, int, int, int], bool, int]]] = {}
        for i, k in enumerate(self.record_indices(pos)):
            rng = np.random.default_rng([self._seed, int(k)])
            pool = self.bg if i < self.num_bg else self.fg
            image, label, x1, y1, x2, y2, line = (int(v) for v in pool[rng.integers(len(pool))])
            flip = self.mirror and bool(rng.integers(2))
            windows.setdefault(image, []).append((i, (x1, y1, x2, y2), flip, line))
            batch.labels[i] = label
        batch.pending = self._pool.run([functools.partial(self._cut, batch, image, items)
                                        for image, items in windows.items()])
        return batch

    def _cut(self, batch: _Batch, image: int,
             items: list[tuple[int, tuple[int, int, int, int], bool, int]]) -> None:
        """One decoding job: a picture, and each of its windows warped into its row."""
        start = time.perf_counter()
        img = self._image(image)
        decoded = time.perf_counter()
        for row, box, flip, line in items:
            self._warp(img, box, flip, batch.data[row], line)
        batch.times.append((decoded - start, time.perf_counter() - decoded))

    def _warp(self, img: np.ndarray, box: tuple[int, int, int, int], flip: bool,
              out: np.ndarray, line: int) -> None:
        """Write one window, warped, into ``out`` (C, crop, crop), which starts at zero."""
        try:
            b = warp_box(box, img.shape[:2], self.crop_size, self.context_pad, self.square, flip)
        except DataError as e:
            raise self.fail(f"{self.source}:{line}: {e}") from None
        if b.out_h <= 0 or b.out_w <= 0:  # a sliver that rounds to nothing
            return
        patch = resize_bilinear(img[b.y1:b.y2 + 1, b.x1:b.x2 + 1], b.out_h, b.out_w)
        if flip:
            patch = patch[:, ::-1]
        where = (slice(None), slice(b.pad_h, b.pad_h + b.out_h), slice(b.pad_w, b.pad_w + b.out_w))
        values = patch.transpose(2, 0, 1).astype(np.float32)
        if self.mean is not None:
            values -= self.mean[where]
        out[where] = values * self.scale


# -- HDF5Output ---------------------------------------------------------------------------------

@register("HDF5Output", "HDF5_OUTPUT")
class HDF5OutputLayer(Layer):
    """Caffe's HDF5Output layer: appends its bottoms (data, label) to the datasets "data" and
    "label" of hdf5_output_param.file_name on every forward; no tops, no gradient.

    As in Caffe, set-up truncates the file and the datasets are 4-D (num, channels, height,
    width: a label vector is saved as N x 1 x 1 x 1), in the blobs' float type. Caffe
    writes each forward's blobs as new datasets, so its second forward fails; appending
    along the first axis is what the layer is for. The file is created atomically and is
    opened, extended and closed on each forward, so a run that stops between forwards leaves
    a valid file holding every row written. A relative file_name's folder is looked up
    beside the net file first, then in the working directory (like snapshot_prefix). With
    several workers, worker ``r`` writes ``<stem>_<r><suffix>``: one file cannot take
    concurrent appends.
    """

    exact_num_bottoms = 2
    exact_num_tops = 0
    DATASETS = ("data", "label")

    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        file_name = self.param.hdf5_output_param.file_name
        if not file_name:
            raise self.fail("hdf5_output_param.file_name is not set")
        self.file_name = self._output_path(file_name)
        h5py = import_h5py()
        try:
            with atomic_path(self.file_name) as tmp, h5py.File(tmp, "w") as f:
                for name, blob in zip(self.DATASETS, bottom):
                    row = self._legacy_shape(blob)[1:]
                    # about a batch per chunk, but under 4 MB: HDF5 caps a chunk at 4 GB
                    row_bytes = max(1, math.prod(row) * blob.dtype.itemsize)
                    rows = max(1, min(blob.shape[0], (4 << 20) // row_bytes))
                    f.create_dataset(name, shape=(0, *row), maxshape=(None, *row),
                                     dtype=blob.dtype, chunks=(rows, *row))
        except OSError as e:
            raise self.fail(f"cannot create HDF5 file {self.file_name}: {e}") from None

    def _output_path(self, file_name: str) -> Path:
        path = Path(file_name)
        ctx = self.context
        if ctx.world_size > 1:
            path = path.with_name(f"{path.stem}_{ctx.rank}{path.suffix}")
        if not path.is_absolute():
            path = ctx.resolve(str(path.parent)) / path.name
        if not path.parent.is_dir():
            raise self.fail(f"folder {path.parent} of hdf5_output_param.file_name does not "
                            f"exist")
        return path

    def _legacy_shape(self, blob: Blob) -> tuple[int, ...]:
        """Caffe's (num, channels, height, width) view of a blob of at most 4 axes."""
        if not 1 <= blob.num_axes() <= 4:
            raise self.fail(f"blob of shape {blob.shape}: Caffe's HDF5 output takes blobs of "
                            f"1 to 4 axes")
        return blob.shape + (1,) * (4 - blob.num_axes())

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].shape[:1] != bottom[1].shape[:1]:
            raise self.fail(f"data ({bottom[0].shape}) and label ({bottom[1].shape}) must have "
                            f"the same number of rows")

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        h5py = import_h5py()
        arrays = [backend.to_numpy(b.data).reshape(self._legacy_shape(b)) for b in bottom]
        try:
            with h5py.File(self.file_name, "a") as f:
                sets = [f[name] for name in self.DATASETS]
                for d, a in zip(sets, arrays):
                    if d.shape[1:] != a.shape[1:]:
                        raise self.fail(f"{self.file_name}: '{d.name.lstrip('/')}' rows are "
                                        f"{d.shape[1:]}, the bottom now gives {a.shape[1:]}")
                for d, a in zip(sets, arrays):
                    n = d.shape[0]
                    d.resize(n + a.shape[0], axis=0)
                    d[n:] = a
        except (OSError, KeyError) as e:
            raise self.fail(f"cannot append to HDF5 file {self.file_name}: {e}") from None
