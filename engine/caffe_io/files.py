"""What every Caffe file format in this package shares: the `FormatError` a reader raises, reads
that turn a missing, truncated or corrupt file into that one-line error, atomic writes, and
telling a file's format from its name or its first bytes.

Every writer is atomic: it writes a temporary file beside the target and renames it into place,
so a crash mid-write never leaves a half-written model where a good one was.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Union

from google.protobuf import message as pb_message

PathLike = Union[str, os.PathLike]

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGIC = b"PK\x03\x04"


class FormatError(ValueError):
    """A file that is not what it claims to be; the message is one line naming file and place."""


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

def _current_umask() -> int:
    # Read once at import: os.umask can only be read by setting it, which races with threads.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it vanishes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file private; give it the mode an ordinary open() would.
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# Guarded reads
# ---------------------------------------------------------------------------------------------

def read_bytes(path: PathLike) -> bytes:
    """The file's bytes; an unreadable file is a FormatError naming it."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None


def parse_binary(data: bytes, msg: pb_message.Message, path: PathLike, kind: str) -> None:
    """Parse binary protobuf `data` (read from `path`, a `kind` file) into `msg`."""
    if data.startswith(HDF5_MAGIC):
        raise FormatError(f"{path}: is an HDF5 file, not a binary {kind} (name it *.h5)")
    try:
        msg.ParseFromString(data)
    except (pb_message.DecodeError, RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: not a valid {kind} (truncated or corrupt): {e}") from None


def import_h5py() -> Any:
    import h5py  # deferred: only HDF5 users pay for the import

    return h5py


@contextlib.contextmanager
def open_h5(path: PathLike, kind: str) -> Iterator[Any]:
    """An HDF5 file open for reading; a missing key or bad dataset inside the block becomes a
    FormatError naming the file as a `kind`."""
    h5py = import_h5py()
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise FormatError(f"{path}: cannot read: No such file or directory") from None
    except OSError as e:
        raise FormatError(f"{path}: not a valid {kind} (truncated or corrupt HDF5): "
                          f"{str(e).splitlines()[0]}") from None
    try:
        yield f
    except (KeyError, OSError, ValueError, TypeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: not a valid {kind}: {str(e).splitlines()[0]}") from None
    finally:
        f.close()


# ---------------------------------------------------------------------------------------------
# Which format a file is
# ---------------------------------------------------------------------------------------------

def format_by_name(path: PathLike) -> str:
    """"hdf5", "npz" or "binary" from the file name alone (what writers go by)."""
    name = str(path).lower()
    if name.endswith((".h5", ".hdf5")):
        return "hdf5"
    if name.endswith(".npz"):
        return "npz"
    return "binary"


def weights_format(path: PathLike) -> str:
    """The format of a file to read: by name, else by the magic bytes of an existing file."""
    fmt = format_by_name(path)
    if fmt != "binary":
        return fmt
    with contextlib.suppress(OSError):
        with open(path, "rb") as fh:
            head = fh.read(8)
        if head.startswith(HDF5_MAGIC):
            return "hdf5"
        if head.startswith(ZIP_MAGIC):
            return "npz"
    return "binary"
