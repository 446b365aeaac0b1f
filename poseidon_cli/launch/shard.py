"""One node's parameter-server shard process: ``python -m poseidon_cli.launch.shard``.

Its worker starts it and it lives and ends with that worker: it ignores SIGINT, SIGTERM and
SIGHUP (the worker acts on those, and needs its shard to snapshot or stop at the agreed
iteration), and ends when its peers say BYE or go silent. Everything it needs comes as one
line of JSON on its standard input (``ShardSettings``: its index, the host table, the job key
and its limits), never on the command line; it reads that line only once its imports are done,
so a worker may start it ahead of time (``ShardStarter.prepare``: an elastic worker needs a new
shard for every generation, and the imports would take a second or two of a recovery).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Sequence

from engine.comm.auth import key_hex, parse_key
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, check_fields, table_from_rows, table_rows

from ..console import run_process
from .exits import ForcedExit

@dataclass(frozen=True)
class ShardSettings:
    """What a shard process is told on its standard input (with the key and the table)."""
    index: int
    timeout: float
    max_frame_bytes: int
    #: summing threads (0: on its receive thread)
    threads: int
    timeline: str | None = None
    #: the start-up window (--startup-timeout)
    startup: float | None = None

    def line(self, key: bytes, entries: Sequence[HostEntry]) -> bytes:
        return (json.dumps({**asdict(self), "key": key_hex(key), "hosts": table_rows(entries)},
                           separators=(",", ":")) + "\n").encode()


def read_settings(text: str) -> tuple[ShardSettings, bytes, list[HostEntry]]:
    """The settings, key and table of a shard's input line, every field checked."""
    where = "the shard's settings on standard input"
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CommError(f"{where}: not JSON ({e})") from None
    timeline = d.pop("timeline", "missing") if isinstance(d, dict) else None
    timeout = d.pop("timeout", "missing") if isinstance(d, dict) else None
    startup = d.pop("startup", None) if isinstance(d, dict) else None
    check_fields(d, {"index": int, "max_frame_bytes": int, "threads": int, "key": str,
                     "hosts": list}, where)

    def seconds(v: object) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    if not (timeline is None or isinstance(timeline, str)) or not seconds(timeout) or not (
            startup is None or seconds(startup)):
        raise CommError(f"{where}: 'timeline', 'timeout' or 'startup' has the wrong type")
    entries = table_from_rows(d["hosts"], where)
    if d["index"] >= len(entries):
        raise CommError(f"shard {d['index']}: the table lists {len(entries)} workers")
    return (ShardSettings(d["index"], float(timeout), d["max_frame_bytes"], d["threads"],
                          timeline, float(startup) if startup is not None else None),
            parse_key(d["key"], where), entries)


def shard_command() -> list[str]:
    return [sys.executable, "-m", "poseidon_cli.launch.shard"]


class ShardStarter:
    """Starts a worker's shard processes: the one ``prepare`` started ahead when there is one
    (it has done its imports), else a new one."""

    def __init__(self) -> None:
        self._ready: subprocess.Popen | None = None

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(shard_command(), stdin=subprocess.PIPE, stderr=subprocess.PIPE)

    def prepare(self) -> None:
        """Start the next shard now, to wait for its settings (an elastic worker calls it once
        a generation trains, so the imports do not compete with the next one's start)."""
        if self._ready is None or self._ready.poll() is not None:
            self._ready = self._spawn()

    def start(self, settings: ShardSettings, key: bytes,
              entries: Sequence[HostEntry]) -> subprocess.Popen:
        proc = self._ready if self._ready is not None and self._ready.poll() is None \
            else self._spawn()
        self._ready = None
        assert proc.stdin is not None
        try:
            proc.stdin.write(settings.line(key, entries))
            proc.stdin.close()
        except BrokenPipeError:  # it died at once; its error line comes through the relay
            pass
        return proc

    def close(self) -> None:
        """Stop the shard started ahead, if any (it holds nothing yet)."""
        if self._ready is not None and self._ready.poll() is None:
            self._ready.kill()
            self._ready.wait()
        self._ready = None


def run_shard(settings: ShardSettings, key: bytes, entries: list[HostEntry]) -> int:
    from engine.comm.shard import ShardServer

    if settings.timeline is not None:
        from engine import timeline as tl
        tl.start(settings.timeline, f"shard {settings.index}", f"shard{settings.index}")
    srv = ShardServer(settings.index, entries, key=key, timeout=settings.timeout,
                      max_frame_bytes=settings.max_frame_bytes, threads=settings.threads,
                      startup=settings.startup)
    ForcedExit().attach(srv.ep)
    try:
        srv.start()
        srv.serve()
    except CommError as e:
        srv.ep.disarm()
        if not srv.ep.error_from_peer:  # its worker shares this stderr and reports relayed ones
            print(f"poseidon: error: {e}", file=sys.stderr)
        return 1
    finally:
        srv.close()
        if settings.timeline is not None:
            tl.current.save_part()
    return 0


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    import engine.comm.shard  # noqa: F401 - before the settings come: a shard started ahead
    try:
        line = sys.stdin.readline()
        if not line:
            return 0  # started ahead and never needed
        settings, key, entries = read_settings(line)
        return run_shard(settings, key, entries)
    except CommError as e:
        print(f"poseidon: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    run_process(main)
