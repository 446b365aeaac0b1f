"""A communication plan on disk: the file a run writes (`<snapshot_prefix>_plan.prototxt`) and
`poseidon train --plan FILE` reads, and the plan a snapshot records.

Which scheme sums which layers decides the order of every floating-point sum, so two runs of
one job give the same bits only when they follow one plan. Rank 0 plans from a probe of the
link, and a probe on a busy machine measures something else each time; a plan that is written
down and read back takes the probe out of the result. The file is poseidon.Plan in protobuf text
format (readable, editable); the nonce, which names what one job creates, is never written.
"""
from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format

from engine.caffe_io import FormatError, atomic_write_bytes, read_solverstate
from engine.caffe_io.files import parse_binary
from engine.pb import poseidon_pb2 as pb

HEADER = ("# Poseidon communication plan: which scheme sums which layers (units in release "
          "order).\n# `poseidon train --plan THIS_FILE` follows it: the same sums in the same "
          "order,\n# whatever the link probe measures.\n")


def plan_text(plan: pb.Plan) -> str:
    """``plan`` as the file says it, without its nonce."""
    copy = pb.Plan()
    copy.CopyFrom(plan)
    copy.ClearField("nonce")
    return HEADER + text_format.MessageToString(copy)


def write_plan(path: str | Path, plan: pb.Plan) -> None:
    """Atomically: a reader sees the previous file or this one."""
    atomic_write_bytes(path, plan_text(plan).encode())


def read_plan(path: str | Path) -> pb.Plan:
    """A plan file, or the plan a .solverstate recorded; FormatError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FormatError(f"plan file {p} not found")
    if ".solverstate" in p.name:
        plan = recorded_plan(p)
        if plan is None:
            raise FormatError(f"{p} records no communication plan (a single-process or Caffe "
                              "snapshot)")
        return plan
    plan = pb.Plan()
    try:
        text_format.Parse(p.read_text(), plan)
    except (text_format.ParseError, UnicodeDecodeError) as e:
        raise FormatError(f"{p}: not a Poseidon plan file ({e})") from None
    if not plan.units or not plan.world_size:
        raise FormatError(f"{p}: a plan file names its units and world_size (write one with "
                          "`poseidon train --hosts ...`: rank 0 writes <snapshot_prefix>_plan."
                          "prototxt)")
    return plan


def recorded_plan(solverstate: str | Path) -> pb.Plan | None:
    """The plan a snapshot of a distributed run recorded (None: it recorded none)."""
    state = read_solverstate(solverstate)
    if not state.sync_state:
        return None
    plan = pb.Plan()
    parse_binary(state.sync_state, plan, solverstate, "recorded communication plan")
    return plan
