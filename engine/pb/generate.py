"""Regenerate (or check) the committed protobuf modules from proto/*.proto.

    python -m engine.pb.generate           # rewrite engine/pb/<name>_pb2.py
    python -m engine.pb.generate --check   # exit 1 when a committed module is stale

The generated modules are committed so that Poseidon runs without protoc; this script (and
tests/test_proto.py, which calls `check`) keeps them honest. Needs grpcio-tools.
"""
from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent


def protos() -> list[Path]:
    """The schemas whose generated modules live in engine/pb."""
    return sorted(PROTO_DIR.glob("*.proto"))


def generate_text(proto: Path) -> str:
    """What protoc generates for `proto`, as text, without touching the committed module."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}",
               f"--python_out={tmp}", str(proto)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"protoc failed on {proto}: {done.stderr.strip()}")
        return (Path(tmp) / f"{proto.stem}_pb2.py").read_text()


def target(proto: Path) -> Path:
    return OUT_DIR / f"{proto.stem}_pb2.py"


def check() -> list[str]:
    """Unified diffs (one per stale module); empty when every module is up to date."""
    diffs = []
    for proto in protos():
        want = generate_text(proto)
        path = target(proto)
        have = path.read_text() if path.exists() else ""
        if want != have:
            diffs.append("".join(difflib.unified_diff(
                have.splitlines(True), want.splitlines(True),
                f"{path.name} (committed)", f"{path.name} (from {proto.name})", n=1)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 when a committed module is stale")
    args = parser.parse_args(argv)
    if args.check:
        diffs = check()
        for d in diffs:
            sys.stdout.write(d[:4000])
        print("stale generated modules" if diffs else "generated modules are up to date")
        return 1 if diffs else 0
    for proto in protos():
        target(proto).write_text(generate_text(proto))
        print(f"wrote {target(proto).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
