"""One node's parameter-server shard process: ``python -m poseidon_cli.launch.shard``.

Its worker starts it and it lives and ends with that worker: it ignores SIGINT, SIGTERM and
SIGHUP (the worker acts on those, and needs its shard to snapshot or stop at the agreed
iteration), and ends when its peers say BYE or go silent. The job key comes in
$POSEIDON_JOB_KEY, which its worker sets (never on the command line), and the host table as
one line of JSON on its standard input.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from engine.comm.auth import KEY_ENV, job_key, key_hex
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, table_from_json
from engine.comm.shard import DEFAULT_THREADS

#: after a fatal error, a process still busy computing is stopped this many seconds later
EXIT_GRACE_S = 2.0


def shard_command(index: int, timeout: float, max_frame_bytes: int, threads: int,
                  timeline: str | None = None) -> list[str]:
    """The shard's command line; its worker writes the host table to its standard input.
    ``threads``: the shard's summing threads (0: on its receive thread)."""
    cmd = [sys.executable, "-m", "poseidon_cli.launch.shard", "--index", str(index),
           "--timeout", f"{timeout:g}", "--max-frame-bytes", str(max_frame_bytes),
           "--threads", str(threads)]
    return cmd + (["--timeline", timeline] if timeline else [])


def shard_env(key: bytes) -> dict[str, str]:
    return {**os.environ, KEY_ENV: key_hex(key)}


def run_shard(index: int, entries: list[HostEntry], timeout: float,
              max_frame_bytes: int | None, threads: int, timeline: str | None = None) -> int:
    from engine.comm.shard import ShardServer

    key = job_key(None)
    if key is None:
        raise CommError(f"shard {index}: no job key in ${KEY_ENV} (its worker sets it)")
    if timeline is not None:
        from engine import timeline as tl
        tl.start(timeline, f"shard {index}", f"shard{index}")
    srv = ShardServer(index, entries, key=key, timeout=timeout, exit_grace=EXIT_GRACE_S,
                      max_frame_bytes=max_frame_bytes, threads=threads)
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
        if timeline is not None:
            tl.current.save_part()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m poseidon_cli.launch.shard")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--max-frame-bytes", type=int, default=None)
    ap.add_argument("--timeline", default=None)
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                    help="summing threads (0: on the receive thread)")
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
    try:
        entries = table_from_json(sys.stdin.readline(), "the host table on standard input")
        if not 0 <= args.index < len(entries):
            raise CommError(f"shard {args.index}: the table lists {len(entries)} workers")
        return run_shard(args.index, entries, args.timeout, args.max_frame_bytes,
                         args.threads, args.timeline)
    except CommError as e:
        print(f"poseidon: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
