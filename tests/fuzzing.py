"""Fuzzing the readers and the wire parser: mutated inputs must end in a clean error, never a
crash (an exception the CLI would show as a traceback) or a hang.

Five targets, each a valid seed input and what Poseidon does with it:
- ``prototxt``: parse a net's text and build the net (TEST phase);
- ``caffemodel``: read a binary net and copy its weights into LeNet;
- ``solverstate``: read a solver state and its history blobs;
- ``binaryproto``: read a mean file;
- ``wire``: the receive path's parser (``Endpoint._parse``) on a message's frames, without
  authentication (the structure a job's own processes could get wrong) and with it;
- ``wire-pieces``: the same parser fed a large message's authenticated pieces one by one,
  with pieces altered, lost, repeated or swapped.

A clean error is what ``poseidon_cli.console.user_errors`` turns into one ``poseidon: error:``
line. ``tests/test_fuzz.py`` runs a few hundred cases per target with hypothesis in CI; the
long run is on demand:

    python -m tests.fuzzing --cases 10000 [--target wire] [--seed 1]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
#: what the CLI reports as one line (poseidon_cli/console.py: user_errors)
CLEAN = (ValueError, OSError, KeyError, RuntimeError, MemoryError)
HANG_S = 10
INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\xff\xff\xff\xff\x0f",
               b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x01", b"\x08"]
NUMBERS = ["0", "-1", "1", "4294967296", "2147483648", "9223372036854775807",
           "18446744073709551616", "1e30", "-1e30", "nan", "inf", "65536", "3.5"]


# ------------------------------------------------------------------------------- mutators
def mutate_bytes(data: bytes, rng: random.Random, rounds: int = 0) -> bytes:
    """1-4 byte-level edits: flips, interesting bytes (varint extremes), inserts, deletes,
    duplicated or truncated spans."""
    b = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randrange(len(b) + 1) if b else 0
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            v = rng.choice(INTERESTING)
            b[i:i + len(v)] = v
        elif op == 2:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 3 and b:
            del b[i:i + rng.randint(1, 16)]
        elif op == 4 and b:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 64)]
        else:
            del b[i:]
    return bytes(b)


def mutate_text(text: str, rng: random.Random) -> str:
    """Numbers become extremes, tokens vanish or repeat, lines are duplicated; sometimes bytes."""
    import re

    if rng.random() < 0.2:
        return mutate_bytes(text.encode(), rng).decode("latin-1")
    lines = text.splitlines()
    for _ in range(rng.randint(1, 3)):
        k = rng.randrange(len(lines))
        op = rng.randrange(4)
        if op == 0:
            nums = list(re.finditer(r"-?\d+(\.\d+)?", lines[k]))
            if nums:
                m = rng.choice(nums)
                lines[k] = lines[k][:m.start()] + rng.choice(NUMBERS) + lines[k][m.end():]
        elif op == 1:
            words = lines[k].split(" ")
            if len(words) > 1:
                del words[rng.randrange(len(words))]
                lines[k] = " ".join(words)
        elif op == 2:
            lines.insert(k, lines[rng.randrange(len(lines))])
        else:
            del lines[k]
            if not lines:
                lines = [""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- targets
@dataclass
class Target:
    name: str
    seed: bytes
    run: Callable[[bytes], Any]
    text: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def mutate(self, rng: random.Random) -> bytes:
        if self.text:
            return mutate_text(self.seed.decode(), rng).encode("latin-1", "replace")
        return mutate_bytes(self.seed, rng)


def _lenet_deploy() -> str:
    return (ROOT / "models" / "lenet" / "deploy.prototxt").read_text()


def _file(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


@contextlib.contextmanager
def make_targets(tmp: Path) -> Iterator[dict[str, Target]]:
    """The five targets, their seeds made here (nothing from ../shared is needed)."""
    from engine import caffe_io
    from engine.net import Net
    from engine.pb import caffe_pb2

    deploy = _lenet_deploy()
    net = Net(_file(tmp, "deploy.prototxt", deploy.encode()), phase="TEST")
    model = caffe_io.net_to_proto(net).SerializeToString()
    state = caffe_pb2.SolverState(iter=7, learned_net="x.caffemodel", current_step=1)
    for p in net.learnable_params[:2]:
        state.history.add().CopyFrom(caffe_io.array_to_blob(np.ones(p.shape, np.float32)))
    state.data_position.extend([448])
    mean = caffe_io.array_to_blob(np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2))

    def prototxt(data: bytes) -> None:
        Net(_file(tmp, "fuzz.prototxt", data), phase="TEST")

    def caffemodel(data: bytes) -> None:
        caffe_io.copy_weights_into(net, _file(tmp, "fuzz.caffemodel", data))

    def solverstate(data: bytes) -> None:
        s = caffe_io.read_solverstate(_file(tmp, "fuzz.solverstate", data))
        caffe_io.solverstate_history(s)

    def binaryproto(data: bytes) -> None:
        caffe_io.read_blobproto(_file(tmp, "fuzz.binaryproto", data))

    yield {"prototxt": Target("prototxt", deploy.encode(), prototxt, text=True),
           "caffemodel": Target("caffemodel", model, caffemodel),
           "solverstate": Target("solverstate", state.SerializeToString(), solverstate),
           "binaryproto": Target("binaryproto", mean.SerializeToString(), binaryproto),
           **wire_targets()}


class Frame(bytes):
    """A received frame as the parser reads it: ZeroMQ's has the same two views and the
    buffer protocol (bytes gives this one the protocol)."""

    @property
    def bytes(self) -> bytes:
        return bytes(self)

    @property
    def buffer(self) -> memoryview:
        return memoryview(self)


def wire_targets() -> dict[str, Target]:
    """The receive path's parser (engine/comm/wire.py, no sockets), fed frames as a peer would
    send them: a 2-array FACTORS message from worker 1, mutated in its header, its frames'
    sizes or its frame count."""
    from engine.comm.auth import Signer, Verifier
    from engine.comm.wire import WORKER, Parser, header
    from engine.pb import poseidon_pb2 as pb

    key = bytes(range(32))
    h = header(pb.DATA, scheme="sfb", sender_role=pb.WORKER, sender=1, layer=3, round=2)
    h.arrays.add(dtype="<f4", shape=[2, 3])
    h.arrays.add(dtype="<f8", shape=[4])
    frames = [h.SerializeToString(), np.ones(6, np.float32).tobytes(), np.ones(4).tobytes()]
    signer = Signer(key)

    def receiver(auth: bool) -> Any:
        """A receiver of messages from worker 1; each case is a sender's first message."""
        parser = Parser(Verifier(key) if auth else None, [(WORKER, 1)], None, str,
                        lambda why: None)
        parser.checker = lambda msg: None  # structure only: content checks are the scheme's
        return parser

    def parse(auth: bool) -> Callable[[bytes], None]:
        def run(data: bytes) -> None:
            fs = json.loads(data.decode("latin-1")) if data[:1] == b"[" else [data]
            msg, reason = receiver(auth).parse([Frame(bytes(f, "latin-1")) for f in fs])
            if msg is None:  # dropped, as a receiver does: the clean outcome
                raise ValueError(reason)
        return run

    def encode(fs: list[bytes]) -> bytes:
        return json.dumps([f.decode("latin-1") for f in fs]).encode("latin-1")

    class WireTarget(Target):
        def mutate(self, rng: random.Random) -> bytes:
            fs = list(self.extra["frames"])
            op = rng.randrange(4)
            if op == 0:    # the header, the part everything else is trusted by
                fs[0] = mutate_bytes(fs[0], rng)
            elif op == 1:  # a frame's size or bytes
                k = rng.randrange(len(fs))
                fs[k] = mutate_bytes(fs[k], rng)
            elif op == 2:  # frames lost or added
                if rng.random() < 0.5 and len(fs) > 1:
                    del fs[rng.randrange(len(fs))]
                else:
                    fs.insert(rng.randrange(len(fs) + 1), mutate_bytes(rng.choice(fs), rng))
            else:          # a header made up from scratch, with absurd arrays
                fake = pb.Header(kind=rng.randrange(12), sender_role=rng.randrange(3),
                                 sender=rng.choice([0, 1, 2, 2 ** 31]), round=rng.randrange(9))
                for _ in range(rng.randrange(4)):
                    fake.arrays.add(dtype=rng.choice(["<f4", "<f8", "|O", "<i8", "", "V8"]),
                                    shape=[rng.choice([0, 1, 3, 2 ** 32, 2 ** 62, -1])
                                           for _ in range(rng.randrange(10))])
                fs[0] = fake.SerializeToString()
            return encode(fs)

    plain = WireTarget("wire", encode(frames), parse(False), extra={"frames": frames})
    signed = WireTarget("wire-auth", encode([*frames, signer.trailer(frames)]), parse(True),
                        extra={"frames": [*frames, signer.trailer(frames)]})
    return {"wire": plain, "wire-auth": signed,
            "wire-pieces": pieces_target(lambda: receiver(True), key, h)}


def pieces_target(receiver: Callable[[], Any], key: bytes, h: Any) -> Target:
    """A message in 5 authenticated pieces of 16 bytes, fed to a fresh receiver's parser in
    order, as its receive thread would: accepted whole, or an error naming why not."""
    from engine.comm.auth import Signer
    from engine.comm.pieces import signed
    from engine.comm.wire import wire_frames

    arrays = [np.arange(6, dtype=np.float32), np.ones(4)]
    seed = [[bytes(memoryview(f)) for f in piece]
            for piece in signed(wire_frames(h, arrays), Signer(key), 16)]

    def run(data: bytes) -> None:
        pieces = [[bytes(f, "latin-1") for f in piece] for piece in json.loads(data)]
        parser = receiver()  # each case is a sender's first message
        why = "no piece"
        for piece in pieces:
            msg, reason = parser.parse([Frame(f) for f in piece])
            if msg is not None:
                for a, b in zip(msg.arrays, arrays, strict=True):
                    if not np.array_equal(a, b):
                        raise AssertionError("an accepted message differs from the one sent")
                return
            why = reason or why
        raise ValueError(why)

    def encode(pieces: list[list[bytes]]) -> bytes:
        return json.dumps([[f.decode("latin-1") for f in piece] for piece in pieces]).encode()

    class PiecesTarget(Target):
        def mutate(self, rng: random.Random) -> bytes:
            ps = [list(p) for p in seed]
            op = rng.randrange(4)
            k = rng.randrange(len(ps))
            if op == 0:    # a frame altered: a piece's bytes, its header or its trailer
                f = rng.randrange(len(ps[k]))
                ps[k][f] = mutate_bytes(ps[k][f], rng)
            elif op == 1:  # a piece lost
                del ps[k]
            elif op == 2:  # a piece repeated
                ps.insert(rng.randrange(len(ps) + 1), list(ps[k]))
            else:          # two pieces swapped
                j = rng.randrange(len(ps))
                ps[k], ps[j] = ps[j], ps[k]
            return encode(ps)

    return PiecesTarget("wire-pieces", encode(seed), run)


# ---------------------------------------------------------------------------------- runner
class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(target: Target, data: bytes) -> tuple[str, str]:
    """("ok" | "clean" | "crash" | "hang", detail) of one input."""
    try:
        with deadline(HANG_S):
            target.run(data)
    except Hang as e:
        return "hang", str(e)
    except CLEAN as e:
        return "clean", type(e).__name__
    except Exception as e:  # noqa: BLE001 - that is the finding
        return "crash", f"{type(e).__name__}: {e} | {traceback.format_exc(limit=3)[-400:]}"
    return "ok", ""


def cli_outcomes(targets: dict[str, Target], cases: int, seed: int, tmp: Path) -> Counter[str]:
    """Mutated nets and weights through the real CLI (`poseidon time --model`, `poseidon
    convert --info`): a traceback, a hang or an exit without its one ``poseidon: error:`` line
    is a finding."""
    import subprocess

    rng = random.Random(f"{seed}:cli")
    counts: Counter[str] = Counter()
    for k in range(cases):
        if k % 2 == 0:
            net = _file(tmp, "cli.prototxt", targets["prototxt"].mutate(rng))
            args = ["time", "--model", str(net), "--iterations", "1"]
        else:
            weights = _file(tmp, "cli.caffemodel", targets["caffemodel"].mutate(rng))
            args = ["convert", "--info", str(weights)]
        try:
            done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            counts["hang"] += 1
            continue
        if "Traceback" in done.stderr:
            counts["traceback"] += 1
        elif done.returncode == 0:
            counts["ok"] += 1
        elif sum(line.startswith("poseidon: error:") for line in done.stderr.splitlines()) == 1:
            counts["clean"] += 1
        else:
            counts["unclear exit"] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzzing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10000, help="inputs per target")
    ap.add_argument("--target", action="append", help="only these (default: all)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cli", type=int, default=0,
                    help="also run this many mutated nets and weights through the CLI")
    ap.add_argument("--json", default=None, help="write the counts here")
    args = ap.parse_args(argv)
    import logging
    logging.disable(logging.CRITICAL)  # dropped-message warnings, by the thousand
    from engine import glog
    glog.set_enabled(False)
    report: dict[str, Any] = {}
    bad = 0
    with tempfile.TemporaryDirectory(prefix="poseidon-fuzz-") as d, \
            make_targets(Path(d)) as targets:
        for name, target in targets.items():
            if args.target and name not in args.target:
                continue
            rng = random.Random(f"{args.seed}:{name}")
            counts: Counter[str] = Counter()
            kinds: Counter[str] = Counter()
            findings: list[str] = []
            t0 = time.monotonic()
            for _ in range(args.cases):
                result, detail = outcome(target, target.mutate(rng))
                counts[result] += 1
                if result == "clean":
                    kinds[detail] += 1
                elif result in ("crash", "hang") and len(findings) < 5:
                    findings.append(detail)
            report[name] = {"cases": args.cases, **{k: counts[k] for k in
                            ("ok", "clean", "crash", "hang")}, "errors": dict(kinds),
                            "seconds": round(time.monotonic() - t0, 1), "findings": findings}
            bad += counts["crash"] + counts["hang"]
            print(f"{name:12} {args.cases} cases: {counts['ok']} accepted, {counts['clean']} clean "
                  f"errors, {counts['crash']} crashes, {counts['hang']} hangs "
                  f"({report[name]['seconds']} s)", flush=True)
            for f in findings:
                print(f"    {f}")
        if args.cli:
            counts = cli_outcomes(targets, args.cli, args.seed, Path(d))
            report["cli"] = dict(counts)
            bad += counts["traceback"] + counts["hang"] + counts["unclear exit"]
            print(f"cli          {args.cli} runs of time/convert: {counts['ok']} ran, "
                  f"{counts['clean']} one-line errors, {counts['traceback']} tracebacks, "
                  f"{counts['hang']} hangs, {counts['unclear exit']} unclear exits", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
