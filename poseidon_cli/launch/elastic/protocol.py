"""The elastic driver's control messages: what each says, and how each is checked.

Every message is two ZeroMQ frames, ``[json][trailer]``: a JSON object with a ``kind`` and the
fields that kind has (exactly those), and an AES-GMAC trailer under the job key
(engine/comm/auth.py), checked before a byte of the JSON is read; never pickled. The
receiver then checks each field's type and range (``parse``). A worker's JOIN carries a nonce
that the driver's answer echoes, so an answer recorded from another run is not taken.

Worker -> driver: ``join``, ``heartbeat``, ``report`` (I am free for the next generation, after
the one I was in ended, failed or I leave; here are the commits I hold), ``ask`` (at a commit:
does the membership change here?), ``started`` (the generation's handshake and state are done;
rank 0 says its plan), ``finished`` (max_iter reached, or the job's stop), ``wrote`` (the commit
the driver asked for is on disk).

Driver -> worker: ``welcome`` / ``refuse`` (the answer to a join), ``heartbeat``, ``assign`` (a
generation: its number, your rank, the table, the commit it starts from and where your state
comes from), ``decision`` (the answer to ``ask``, the same for every worker of the
generation), ``abort`` (the generation failed: who and why), ``write`` (the job stops: write
this commit to disk), ``exit``, ``signal`` (the launcher got SIGINT or SIGHUP).

Each generation's messages between the workers go under a key of its own, derived from the
job key (``generation_key``): a message of an older generation fails authentication in a
newer one.
"""
from __future__ import annotations

import hmac
import json
import math
from typing import Any

from engine.comm.auth import Signer, Verifier
from engine.comm.errors import CommError
from engine.comm.hosts import HostsError, check_host, table_from_rows

#: the largest message a worker sends (a report's reason is cut to REASON_CHARS)
WORKER_MESSAGE_BYTES = 16 << 10
#: the largest message the driver sends (an assignment carries the whole table)
DRIVER_MESSAGE_BYTES = 4096 + 256 * 65536
REASON_CHARS = 2000
NONCE_CHARS = 32
COMMITS_HELD = 2

#: where a member's state comes from at the start of a generation
SOURCES = ("start", "memory", "peer")
#: how a member's previous generation went
STATUSES = ("new", "ended", "failed", "left")
ANSWERS = ("continue", "regroup", "abort")
ACTIONS = ("stop", "snapshot")

_FIELDS: dict[str, dict[str, Any]] = {
    # worker -> driver
    "join": {"nonce": str, "host": str, "port": int, "machine": str, "pid": int},
    "heartbeat": {},
    "report": {"gen": int, "status": STATUSES, "commits": list, "iter": int, "reason": str},
    "ask": {"gen": int, "iter": int},
    "started": {"gen": int, "plan": str},
    "finished": {"gen": int, "iter": int},
    "wrote": {"path": str, "reason": str},
    # driver -> worker
    "welcome": {"nonce": str, "wid": int},
    "refuse": {"nonce": str, "reason": str},
    "assign": {"gen": int, "rank": int, "hosts": list, "commit": int, "source": SOURCES,
               "joiners": list, "iter_size": int, "lr_scale": float, "commit_every": int},
    "decision": {"gen": int, "iter": int, "answer": ANSWERS},
    "abort": {"gen": int, "reason": str},
    "write": {"commit": int},
    "exit": {"reason": str},
    "signal": {"action": ACTIONS},
}
WORKER_KINDS = frozenset(("join", "heartbeat", "report", "ask", "started", "finished", "wrote"))
DRIVER_KINDS = frozenset(_FIELDS) - WORKER_KINDS | {"heartbeat"}


def generation_key(job_key: bytes, generation: int) -> bytes:
    """The key of one generation's messages between workers (and their shards)."""
    return hmac.new(job_key, b"poseidon-elastic-generation-" + str(generation).encode(),
                    "sha256").digest()


def encode(signer: Signer, kind: str, **fields: Any) -> list[bytes]:
    """The frames of one message (``fields``: exactly the kind's)."""
    assert set(fields) == set(_FIELDS[kind]), (kind, sorted(fields))
    payload = json.dumps({"kind": kind, **fields}, separators=(",", ":")).encode()
    return [payload, signer.trailer([payload])]


def authenticate(verifier: Verifier, frames: list[bytes], sender: object) -> bytes | None:
    """The payload of ``frames`` when they are a message of this job from ``sender`` (not a
    replay); None when not (it is dropped, as the transport drops such messages)."""
    if len(frames) != 2:
        return None
    verdict = verifier.verify(frames[:1], frames[1])
    if isinstance(verdict, str) or verdict.count != 1 or \
            verifier.accept(sender, verdict.session, verdict.counter) is not None:
        return None
    return frames[0]


def parse(payload: bytes, kinds: frozenset[str], who: str) -> dict[str, Any]:
    """A message's fields, each checked (type, sign, range, length); CommError naming ``who``
    (the sender) and the field. ``kinds``: those this side may receive."""
    try:
        d = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CommError(f"{who}: a control message that is not JSON") from None
    if not isinstance(d, dict) or d.get("kind") not in kinds:
        kind = d.get("kind") if isinstance(d, dict) else None
        raise CommError(f"{who}: an unexpected control message {str(kind)[:40]!r}")
    kind = d.pop("kind")
    spec = _FIELDS[kind]
    if set(d) != set(spec):
        raise CommError(f"{who}: a {kind} message with fields {sorted(d)[:20]}, expected "
                        f"{sorted(spec)}")
    for name, want in spec.items():
        _check(d[name], want, f"{who}: {kind} field {name!r}")
    if "hosts" in d:
        try:
            d["hosts"] = table_from_rows(d["hosts"], f"{who}: assign's table")
        except HostsError as e:
            raise CommError(str(e)) from None
        world = len(d["hosts"])
        if d["rank"] >= world:
            raise CommError(f"{who}: assign gives rank {d['rank']} of {world}")
        j = d["joiners"]
        if not all(isinstance(r, int) and not isinstance(r, bool) and 0 < r < world
                   for r in j) or len(set(j)) != len(j):
            raise CommError(f"{who}: assign field 'joiners' is {str(j)[:80]}, expected ranks "
                            f"1..{world - 1}")
    if "commits" in d:
        c = d["commits"]
        if len(c) > COMMITS_HELD or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and i >= 0 for i in c):
            raise CommError(f"{who}: report field 'commits' is {str(c)[:80]}, expected at most "
                            f"{COMMITS_HELD} iterations")
    if kind == "join":
        try:
            check_host(d["host"], f"{who}: join")
        except HostsError as e:
            raise CommError(str(e)) from None
        if not 0 < d["port"] < 65535 or not 0 < len(d["machine"]) <= 255:
            raise CommError(f"{who}: join field 'port' or 'machine' out of range")
    if "nonce" in d and len(d["nonce"]) != NONCE_CHARS:
        raise CommError(f"{who}: {kind} field 'nonce' has {len(d['nonce'])} characters")
    if kind == "assign" and not (d["iter_size"] >= 1 and d["commit_every"] >= 1):
        raise CommError(f"{who}: assign's iter_size and commit_every must be at least 1")
    d["kind"] = kind
    return d


def _check(value: Any, want: Any, what: str) -> None:
    if isinstance(want, tuple):  # one of these strings
        if value not in want:
            raise CommError(f"{what} is {str(value)[:40]!r}, expected one of {', '.join(want)}")
    elif want is int:
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 63):
            raise CommError(f"{what} is {str(value)[:40]!r}, expected a whole number >= 0")
    elif want is float:
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            raise CommError(f"{what} is {str(value)[:40]!r}, expected a positive number")
    elif want is str:
        if not isinstance(value, str) or len(value) > 4 * REASON_CHARS:
            raise CommError(f"{what} is not a string of at most {4 * REASON_CHARS} characters")
    elif want is list:
        if not isinstance(value, list):
            raise CommError(f"{what} is not a list")
    else:  # a kind of field this module does not know: a bug here, not bad input
        raise TypeError(f"no check for {want!r}")
