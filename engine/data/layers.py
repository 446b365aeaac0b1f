"""Caffe's stream data layers: the stream they share (StreamDataLayer), the image stream of
Data and ImageData, and Data (LMDB/LevelDB). ImageData is image_list.py's, MemoryData
memory.py's, WindowData window.py's, HDF5Data and HDF5Output hdf5.py's.

Every data layer reads an endless *stream* of records: record ``k`` of the stream is record
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
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np

from .. import backend, glog
from ..blob import Blob
from ..layers.base import Layer, register
from ..pb import caffe_pb2
from .datum import DataError, datum_image, datum_is_encoded
from .decoders import DecoderPool, DecodeStats, Pending, default_decoders
from .lmdb_source import DBSource, SourceNotFound, open_db
from .prefetch import Prefetcher
from .transformer import DataTransformer, crop_draws

#: LMDB folder name fragment -> the `poseidon data` subcommand that writes it
_MAKERS = (("fashion", "fashion-mnist"), ("mnist", "mnist"), ("cifar", "cifar10"),
           ("digits", "digits"))


def _how_to_make(path: Path) -> str:
    name = path.name.lower()
    for fragment, command in _MAKERS:
        if fragment in name:
            return f"make it with `poseidon data {command} --out {path.parent}`"
    return (f"make it from your images with `poseidon data images --list LIST --root ROOT "
            f"--out {path}` (Caffe's convert_imageset), or a public set with `poseidon data "
            f"mnist|cifar10|fashion-mnist|digits --out DIR`")


def _nearest_database(places: Sequence[Path]) -> Path | None:
    """A database beside one of ``places`` whose name is close to the one asked for (a
    typo), or None."""
    import difflib

    for place in places:
        try:
            beside = [d.name for d in place.parent.iterdir()
                      if (d / "data.mdb").is_file() or (d / "CURRENT").is_file()]
        except OSError:
            continue
        near = difflib.get_close_matches(place.name, beside, n=1, cutoff=0.75)
        if near:
            return place.parent / near[0]
    return None


class PendingBatch:
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
    if isinstance(batch, PendingBatch) and batch.pending is not None:
        batch.pending.cancel()


class StreamDataLayer(Layer):
    """Base of the data layers: batches by stream index, striding, position/seek, prefetch.

    A subclass's ``setup`` calls ``_init_stream`` and implements ``_load(pos)``, which returns
    the tops' arrays (NumPy) for the batch starting at stream index ``pos``, or a ``PendingBatch``
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
        pixels: a thread mostly copies them, and a training worker's cores have its net to run
        (a data-only net ran 1.74x faster with two on the 2-core VM, ``poseidon bench data``;
        ``decoders`` sets it where the data path holds a run back)."""
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
        batch = self._complete(loaded) if isinstance(loaded, PendingBatch) else loaded
        self.stats.wait_s += time.perf_counter() - start
        self._pos += self.step
        return batch

    def _load(self, pos: int) -> "tuple[np.ndarray, ...] | PendingBatch":
        raise NotImplementedError

    def _complete(self, batch: PendingBatch) -> tuple[np.ndarray, ...]:
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

    def _load(self, pos: int) -> PendingBatch:
        start = time.perf_counter()
        indices = [int(k) for k in self.record_indices(pos)]
        records = [self._fetch(k) for k in indices]
        self.stats.read_s += time.perf_counter() - start
        data = self._free.pop() if self._free else np.empty((self.batch_size, *self._row_shape),
                                                             dtype=np.float32)
        batch = PendingBatch(data, np.empty(self.batch_size, dtype=np.float32))
        draws = self._draws(indices)
        batch.pending = self._pool.run([functools.partial(self._fill, batch, row, record, draw)
                                        for row, (record, draw) in enumerate(zip(records, draws))])
        return batch

    def _draws(self, indices: list[int]) -> list[tuple[int, int, int] | None]:
        """Each row's random words (crop_draws): a function of its stream index."""
        if not self.transformer.random:
            return [None] * len(indices)
        return [tuple(row) for row in crop_draws(self._seed, np.asarray(indices)).tolist()]

    def _fill(self, batch: PendingBatch, row: int, record: _Record,
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

    def _place(self, batch: PendingBatch, row: int, draw: tuple[int, int, int] | None,
               image: np.ndarray, label: int) -> None:
        with self._named_errors():
            shape = self.transformer.output_shape(image.shape)
        out = (batch.data[row] if shape == batch.data.shape[1:]
               else batch.odd.setdefault(row, np.empty(shape, dtype=np.float32)))
        self.transformer.transform_into(image, out, draw)
        batch.labels[row] = label

    def _complete(self, batch: PendingBatch) -> tuple[np.ndarray, ...]:
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
                # each place once: two bases of the search can be one folder
                places = list(dict.fromkeys(Path(os.path.abspath(p))
                                            for p in ctx.candidates(source)))
                looked = "" if len(places) == 1 else " (nor " + ", ".join(
                    str(p) for p in places[1:]) + ")"
                named = "" if Path(source).is_absolute() else f", from source {source!r}"
                near = _nearest_database(places)
                advice = f"did you mean {near}?" if near else _how_to_make(places[0])
                raise DataError(f"{backend_name} not found: {places[0]}{looked}{named} "
                                f"({advice})") from None
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


