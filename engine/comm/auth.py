"""Message authentication for the processes of one job: AES-GMAC under a per-job secret.

Every message carries a trailer frame ``session (16) | counter (8) | tag (16)``. The tag is
AES-256-GMAC over every other frame (with their count and lengths, so frames cannot be moved
between messages) under a session key derived from the job key and the sender's random
session id; the nonce is the counter, which each sending process increments per message, so a
(key, nonce) pair is never used twice. A receiver checks the tag before it reads a byte of the
header, then, once the header names the sender, that the sender keeps one session and that its
counters only grow: a forged, altered or replayed message is dropped.

Why GMAC and not HMAC-SHA256: GHASH runs at 15-20 GB/s on a core with carry-less multiply
(measured 19 GB/s here against 1.6 GB/s for HMAC-SHA256), so authenticating a 64 MB gradient
costs a few ms, not more than sending it over 10 GbE. Payloads are authenticated, not
encrypted: gradients are not secret from whoever can read the wire, but nobody without the key
can change them or stop the job.

The job key is 32 random bytes, written in hex. It reaches a process as a key file
(``--key-file``, made by ``poseidon keygen``; it must be readable by its owner only) or in the
``POSEIDON_JOB_KEY`` environment variable, which the launcher sets for the processes it starts.
It is never on a command line (``ps`` shows those to every user).
"""
from __future__ import annotations

import hmac
import os
import stat
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Sequence

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .errors import CommError

KEY_BYTES = 32
KEY_ENV = "POSEIDON_JOB_KEY"
SESSION_BYTES = 16
TAG_BYTES = 16
TRAILER_BYTES = SESSION_BYTES + 8 + TAG_BYTES
_MAGIC = b"poseidon-gmac-v1"
_SESSIONS_KEPT = 1024  # derived keys cached; a job has two sessions per node
#: below this many bytes a message is joined and tagged in one call (3 us instead of 10)
_ONE_CALL_BYTES = 1 << 18


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def key_hex(key: bytes) -> str:
    return key.hex()


def parse_key(text: str, where: str) -> bytes:
    """A job key from its hex text; ``where`` names the source in the error."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise CommError(f"{where}: not a job key (expected {2 * KEY_BYTES} hex digits; make one "
                        "with `poseidon keygen FILE`)") from None
    if len(key) != KEY_BYTES:
        raise CommError(f"{where}: a job key has {2 * KEY_BYTES} hex digits, this has "
                        f"{len(text)}")
    return key


def write_key_file(path: str | Path, key: bytes | None = None, force: bool = False) -> bytes:
    """Write a new job key to ``path``, readable by its owner only (0600)."""
    key = new_key() if key is None else key
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (0 if force else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise CommError(f"{path}: exists; give --force to replace it") from None
    except OSError as e:
        raise CommError(f"{path}: cannot write the key: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key_hex(key) + "\n")
    return key


def read_key_file(path: str | Path) -> bytes:
    """The job key in ``path``, refused when others than its owner may read it (as ssh does)."""
    path = Path(path)
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise CommError(f"--key-file {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CommError(f"--key-file {path}: readable by others (mode {stat.S_IMODE(st.st_mode):o});"
                        f" run `chmod 600 {path}`")
    return parse_key(text, f"--key-file {path}")


def job_key(key_file: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's key from ``key_file``, else from $POSEIDON_JOB_KEY, else None."""
    if key_file is not None:
        return read_key_file(key_file)
    env = os.environ if environ is None else environ
    text = env.get(KEY_ENV, "")
    return parse_key(text, f"${KEY_ENV}") if text.strip() else None


class _SessionKey:
    """AES-256 key of one session (HMAC-SHA256 of the job key and the session id)."""

    def __init__(self, key: bytes, session: bytes) -> None:
        self.key = hmac.new(key, _MAGIC + session, "sha256").digest()
        self.aead = AESGCM(self.key)

    def tag(self, counter: int, frames: Sequence[object]) -> bytes:
        """GMAC of the frames, their count and lengths; the same tag whichever way computed:
        small messages in one call, large ones streamed without a copy."""
        nonce = counter.to_bytes(12, "big")
        views = [memoryview(f) for f in frames]  # type: ignore[arg-type]
        head = _MAGIC + struct.pack("<I", len(views))
        if sum(v.nbytes for v in views) <= _ONE_CALL_BYTES:
            aad = head + b"".join(struct.pack("<Q", v.nbytes) + v.tobytes() for v in views)
            return self.aead.encrypt(nonce, b"", aad)
        enc = Cipher(algorithms.AES(self.key), modes.GCM(nonce)).encryptor()
        enc.authenticate_additional_data(head)
        for v in views:
            enc.authenticate_additional_data(struct.pack("<Q", v.nbytes))
            if v.nbytes:
                enc.authenticate_additional_data(v)
        enc.finalize()
        return enc.tag


class Signer:
    """One sending process: its session and counter. Not thread-safe: call under the send lock."""

    def __init__(self, key: bytes) -> None:
        self.session = os.urandom(SESSION_BYTES)
        self._key = _SessionKey(key, self.session)
        self._counter = 0

    def trailer(self, frames: Sequence[object]) -> bytes:
        self._counter += 1
        return (self.session + struct.pack(">Q", self._counter)
                + self._key.tag(self._counter, frames))


class Verifier:
    """One receiving process: checks tags, then each sender's session and counter order."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._derived: OrderedDict[bytes, _SessionKey] = OrderedDict()
        self._last: dict[object, tuple[bytes, int]] = {}

    def verify(self, frames: Sequence[object], trailer: object) -> tuple[bytes, int] | str:
        """(session, counter) when ``trailer`` authenticates ``frames``, else why not."""
        raw = bytes(memoryview(trailer))  # type: ignore[arg-type]
        if len(raw) != TRAILER_BYTES:
            return "no authentication trailer (a process without this job's key?)"
        session, counter, tag = raw[:SESSION_BYTES], raw[SESSION_BYTES:-TAG_BYTES], raw[-TAG_BYTES:]
        n = struct.unpack(">Q", counter)[0]
        key = self._derived.get(session)
        if key is None:
            key = _SessionKey(self._key, session)
        if not hmac.compare_digest(key.tag(n, frames), tag):
            return "failed authentication (forged, altered, or sent with another job's key)"
        if session not in self._derived:  # cache only what authenticated
            self._derived[session] = key
            if len(self._derived) > _SESSIONS_KEPT:
                self._derived.popitem(last=False)
        return session, n

    def accept(self, sender: object, session: bytes, counter: int) -> str | None:
        """Record an authenticated message of ``sender``; why not, when it is a replay."""
        last = self._last.get(sender)
        if last is not None:
            if last[0] != session:
                return "a second session for one sender (a replayed or restarted process)"
            if counter <= last[1]:
                return f"replayed message (counter {counter} after {last[1]})"
        self._last[sender] = (session, counter)
        return None
