"""Caffe's databases of Datum records: read them by record index, write them in key order.

A Caffe Data layer walks its database with a cursor in key order and starts again at the
first record when it reaches the end. ``DBSource.get(k)`` returns record ``k mod N`` of that
endless stream, so a data layer can name any record by its stream index: this is what makes
rank striding (each worker picks its own records out of the shared stream) and exact resume
(seek to a stream index) simple. The cursor only moves forward between calls that go
forward, so reading in order, or with a stride, costs one cursor step per record.

LMDB is read through ``lmdb``; LevelDB (Caffe's default backend) through ``plyvel`` when it
is installed.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Iterable, Iterator

from .datum import DataError

class SourceNotFound(DataError):
    """The database named by a data layer does not exist."""


#: Caffe's own LMDB map size on 64-bit Linux; the file grows only as records are written.
MAP_SIZE = 1 << 40


class DBSource:
    """Read-only access to a Caffe database by stream index. Not thread-safe: one reader."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._count = 0
        self._index = -1  # position of the cursor in key order; -1 = not placed yet

    def __len__(self) -> int:
        return self._count

    def get(self, k: int) -> tuple[bytes, bytes]:
        """(key, value) of record ``k mod len(self)`` in key order."""
        j = k % self._count
        if j < self._index or self._index < 0:
            self._first()
            self._index = 0
        while self._index < j:
            self._next()
            self._index += 1
        return self._item()

    def following(self, key: bytes) -> tuple[bytes, bytes]:
        """(key, value) of the record after ``key`` in key order; after the last, the first
        (the stream wraps). Moves the cursor: the next ``get`` starts from the first record."""
        self._index = -1
        return self._after(key)

    def close(self) -> None:
        """Release the database (further reads fail)."""

    # backend hooks
    def _after(self, key: bytes) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def _first(self) -> None:
        raise NotImplementedError

    def _next(self) -> None:
        raise NotImplementedError

    def _item(self) -> tuple[bytes, bytes]:
        raise NotImplementedError


# py-lmdb allows one Environment per database per process, and a TRAIN and a TEST net (or
# several local workers' layers) may read the same one: share it, counting its users.
_ENVS: dict[str, list[Any]] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: Path) -> Any:
    import lmdb
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is None:
            # lock=False: shared read-only fixtures (and NFS) cannot take the writer lock file
            env = lmdb.open(key, readonly=True, lock=False, readahead=False, subdir=True)
            entry = _ENVS[key] = [env, 0]
        entry[1] += 1
        return entry[0]


def _release_env(path: Path) -> None:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        entry = _ENVS[key]
        entry[1] -= 1
        if entry[1] == 0:
            entry[0].close()
            del _ENVS[key]


class LMDBSource(DBSource):
    """``zero_copy``: values are read-only memoryviews of the memory-mapped file instead of
    bytes (no copy of each record), valid while this source is open: its read transaction
    keeps the pages they show in place."""

    def __init__(self, path: Path, zero_copy: bool = False):
        super().__init__(path)
        import lmdb
        if not (self.path / "data.mdb").is_file():
            raise SourceNotFound(f"LMDB not found: {self.path}")
        self._env = None
        try:
            self._env = _acquire_env(self.path)
            self._txn = self._env.begin(buffers=zero_copy)
            self._count = self._txn.stat()["entries"]
            self._cursor = self._txn.cursor()
        except lmdb.Error as e:
            self.close()
            hint = ""
            if "already open in this process" in str(e):  # LMDB allows one per process
                hint = (": this process opened it itself (lmdb.open in your script?); close "
                        "that environment (env.close()) before building the net, or read the "
                        "records through the net's data layer")
            raise DataError(f"cannot open LMDB {self.path}: {e}{hint}") from None
        if self._count == 0:
            self.close()
            raise DataError(f"LMDB is empty: {self.path}")

    def _first(self) -> None:
        self._cursor.first()

    def _next(self) -> None:
        self._cursor.next()

    def _item(self) -> tuple[bytes, bytes]:
        return bytes(self._cursor.key()), self._cursor.value()

    def _after(self, key: bytes) -> tuple[bytes, bytes]:
        found = self._cursor.set_range(key)  # the first key >= key
        if found and self._cursor.key() == key:
            found = self._cursor.next()
        if not found:
            self._cursor.first()
        return self._item()

    def close(self) -> None:
        if self._env is not None:
            if hasattr(self, "_txn"):
                self._txn.abort()
            _release_env(self.path)
            self._env = None


class LevelDBSource(DBSource):
    def __init__(self, path: Path):
        super().__init__(path)
        try:
            import plyvel  # type: ignore
        except ImportError:
            raise DataError(f"{self.path}: backend LEVELDB needs the plyvel package "
                            "(pip install plyvel), or convert the data set to LMDB") from None
        if not self.path.is_dir():
            raise SourceNotFound(f"LevelDB not found: {self.path}")
        self._db = plyvel.DB(str(self.path), create_if_missing=False)
        self._count = sum(1 for _ in self._db.iterator(include_value=False))
        if self._count == 0:
            raise DataError(f"LevelDB is empty: {self.path}")
        self._it: Iterator[tuple[bytes, bytes]] = iter(())
        self._cur: tuple[bytes, bytes] = (b"", b"")

    def _first(self) -> None:
        self._it = self._db.iterator()
        self._cur = next(self._it)

    def _next(self) -> None:
        self._cur = next(self._it)

    def _item(self) -> tuple[bytes, bytes]:
        return self._cur

    def _after(self, key: bytes) -> tuple[bytes, bytes]:
        for item in self._db.iterator(start=key, include_start=False):
            return item
        return next(self._db.iterator())

    def close(self) -> None:
        self._db.close()


def open_db(path: Path, backend: str = "LMDB", zero_copy: bool = False) -> DBSource:
    """Open a database for reading; ``backend`` is Caffe's DataParameter.DB name.
    ``zero_copy`` (LMDB): values are views of the file's pages, valid while it is open."""
    if backend == "LMDB":
        return LMDBSource(path, zero_copy)
    if backend == "LEVELDB":
        return LevelDBSource(path)
    raise DataError(f"{path}: unknown database backend {backend!r}")


def open_lmdb_writer(path: Path) -> Any:
    """An LMDB environment to write ``path`` (created) with Caffe's map size; commits go to
    the page cache and reach the disk at ``env.sync(True)``."""
    import lmdb
    Path(path).mkdir(parents=True, exist_ok=True)
    return lmdb.open(str(path), map_size=MAP_SIZE, subdir=True, meminit=False, map_async=True)


def write_lmdb(path: Path, records: Iterable[tuple[bytes, bytes]], overwrite: bool = False) -> int:
    """Write (key, value) records to a new LMDB in one transaction; returns the count.

    Refuses to touch an existing database unless ``overwrite`` (Caffe's converters refuse too).
    """
    path = Path(path)
    if (path / "data.mdb").exists():
        if not overwrite:
            raise DataError(f"{path} already exists (remove it, or pass --force)")
        for name in ("data.mdb", "lock.mdb"):
            (path / name).unlink(missing_ok=True)
    env = open_lmdb_writer(path)
    n = 0
    try:
        with env.begin(write=True) as txn:
            cursor = txn.cursor()
            for key, value in records:
                cursor.put(key, value)
                n += 1
        env.sync(True)
    finally:
        env.close()
    return n
