"""Caffe's data layers: Data (LMDB/LevelDB), ImageData, HDF5Data, MemoryData.

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
- **Deterministic prefetch.** The prefetch thread computes the same pure function ahead of
  time, in order (engine.data.prefetch). Random crops, mirrors and shuffles draw from a
  Generator seeded by (a seed drawn once from ``engine.backend.rng()`` at set-up, the stream
  index), never from a shared stream, so they do not depend on threads, workers or restarts.

``rand_skip`` (Data, ImageData) starts the stream at a random index below ``rand_skip``, as
older Caffe did (Caffe 1.0's Data layer ignores the field).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .. import backend
from ..pb import caffe_pb2
from ..blob import Blob
from ..layers.base import Layer, register
from .datum import DataError, datum_to_array, load_image, parse_datum
from .lmdb_source import DBSource, SourceNotFound, open_db
from .prefetch import Prefetcher
from .transformer import DataTransformer

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


class StreamDataLayer(Layer):
    """Base of the data layers: batches by stream index, striding, position/seek, prefetch.

    A subclass's ``setup`` calls ``_init_stream`` and implements ``_load(pos)``, which returns
    the tops' arrays (NumPy) for the batch starting at stream index ``pos``.
    """

    exact_num_bottoms = 0
    min_tops = 1
    batch_size: int = 0
    _prefetch_depth: int = 0
    _prefetcher: Prefetcher | None = None

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
        if self._prefetch_depth > 0:
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self._load, self._pos, self.step,
                                              self._prefetch_depth, name=f"prefetch '{self.name}'")
            _, batch = self._prefetcher.get()
        else:
            batch = self._load(self._pos)
        self._pos += self.step
        return batch

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def _shape_tops(self, top: Sequence[Blob], shapes: Sequence[tuple[int, ...]]) -> None:
        for blob, shape in zip(top, shapes):
            blob.reshape(shape)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Tops keep the shape of the last batch (set at set-up from the first record)."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        batch = self.next_batch()
        for blob, array in zip(top, batch):
            blob.reshape(array.shape)
            xp = backend.get_array_module(blob.data)
            blob.data[...] = xp.asarray(array)

    def close(self) -> None:
        """Stop the prefetch thread and release the source."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None


class _ImageStreamLayer(StreamDataLayer):
    """Shared by Data and ImageData: images through a DataTransformer, optional labels."""

    max_tops = 2

    def _init_transformer(self) -> None:
        tp = self.param.transform_param
        mean = self.context.resolve(tp.mean_file) if tp.HasField("mean_file") else None
        with self._named_errors():
            self.transformer = DataTransformer(tp, self.phase, mean, where="transform_param")
        self._seed = self._draw_seed() if self.transformer.random else 0

    def _transform(self, images: list[np.ndarray], labels: list[int],
                   indices: np.ndarray) -> tuple[np.ndarray, ...]:
        if len({im.shape for im in images}) > 1:
            raise self.fail(f"images of different shapes in one batch ({images[0].shape} and "
                            f"others); set batch_size 1 or resize them")
        rngs = ([np.random.default_rng([self._seed, int(k)]) for k in indices]
                if self.transformer.random else None)
        with self._named_errors():
            data = self.transformer.transform(np.stack(images), rngs)
        return data, np.asarray(labels, dtype=np.float32)

    def _setup_tops(self, top: Sequence[Blob], first: np.ndarray) -> None:
        with self._named_errors():
            shape = self.transformer.output_shape(first.shape)
        self._shape_tops(top, [(self.batch_size, *shape), (self.batch_size,)])


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
        with self._named_errors():
            try:
                self._db: DBSource = open_db(self.source, backend_name)
            except SourceNotFound:
                shown = Path(os.path.normpath(self.source))
                raise DataError(f"{backend_name} not found: {shown} "
                                f"({_how_to_make(shown)})") from None
        self._init_transformer()
        skip = int(backend.rng().integers(dp.rand_skip)) if dp.rand_skip else 0
        self._init_stream(dp.batch_size, skip, strided=not own_files, prefetch=dp.prefetch)
        self._setup_tops(top, self._read(int(self.record_indices(self._pos)[0]))[0])

    def _read(self, k: int) -> tuple[np.ndarray, int]:
        key, value = self._db.get(k)
        try:
            datum = parse_datum(value)
            return datum_to_array(datum, self.transformer.color), datum.label
        except DataError as e:
            raise self.fail(f"corrupt record {k % len(self._db)} (key {key!r}) in "
                            f"{self.source}: {e}") from None

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        indices = self.record_indices(pos)
        images, labels = zip(*(self._read(int(k)) for k in indices))
        return self._transform(list(images), list(labels), indices)

    def close(self) -> None:
        super().close()
        self._db.close()


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
        self._perm_epoch, self._perm = -1, np.arange(0)
        skip = int(backend.rng().integers(ip.rand_skip)) if ip.rand_skip else 0
        # Caffe's prefetching layers all take their queue depth from data_param.prefetch
        self._init_stream(ip.batch_size, skip, strided=True,
                          prefetch=self.param.data_param.prefetch)
        self._setup_tops(top, self._read(int(self.record_indices(self._pos)[0]))[0])

    def _read_list(self, path: Path) -> list[tuple[str, int]]:
        try:
            text = path.read_text()
        except OSError as e:
            raise self.fail(f"cannot read image list {path}: {e.strerror}") from None
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            name, _, label = line.rpartition(" ")
            try:
                lines.append((name.strip(), int(label)))
            except ValueError:
                raise self.fail(f"{path}:{n}: expected '<image path> <integer label>', "
                                f"got {line!r}") from None
        if not lines:
            raise self.fail(f"image list {path} is empty")
        return lines

    def _line(self, k: int) -> tuple[str, int]:
        epoch, j = divmod(k, len(self.lines))
        if self._shuffle_seed:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self._shuffle_seed, epoch]).permutation(
                    len(self.lines))
                self._perm_epoch = epoch
            j = int(self._perm[j])
        return self.lines[j]

    def _read(self, k: int) -> tuple[np.ndarray, int]:
        ip = self.param.image_data_param
        name, label = self._line(k)
        # Caffe concatenates root_folder and the listed name as strings
        path = self.context.resolve(ip.root_folder + name)
        with self._named_errors():
            return load_image(path, ip.is_color, ip.new_height, ip.new_width), label

    def _load(self, pos: int) -> tuple[np.ndarray, ...]:
        indices = self.record_indices(pos)
        images, labels = zip(*(self._read(int(k)) for k in indices))
        return self._transform(list(images), list(labels), indices)


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
