"""Caffe's HDF5 layers: HDF5Data, which streams the rows of the datasets in listed .h5 files,
and HDF5Output, which appends two blobs to an HDF5 file."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import backend
from ..blob import Blob
from ..caffe_io.files import atomic_path, import_h5py
from ..layers.base import Layer, register
from .layers import StreamDataLayer


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
