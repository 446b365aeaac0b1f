"""A plan written down and followed again: the plan file, the plan a snapshot records, and the
checks that refuse a recorded plan where this run differs (workers, machines, wire, net)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.caffe_io import (
    FormatError,
    array_to_blob,
    read_solverstate,
    write_solverstate,
)
from engine.comm.cost import LayerInfo
from engine.comm.link import Link
from engine.comm.plan_file import plan_text, read_plan, recorded_plan, write_plan
from engine.comm.planner import PlanMismatch, PlanOptions, make_plan, pin_plan
from engine.pb import caffe_pb2

CONV = LayerInfo(1, "conv1", [(8, 1, 3, 3), (8,)])
IP1 = LayerInfo(3, "ip1", [(256, 512), (256,)], factors=(16, 512, 256))
IP2 = LayerInfo(5, "ip2", [(10, 256), (10,)], factors=(16, 256, 10))
LAYERS = [CONV, IP1, IP2]
SLOW = Link(5e-3, 8e-8, "given: 100mbit@5ms")
#: the same latency, a thousand times the bandwidth: one bucket of a dense scheme, where the slow
#: link sends the InnerProducts' sufficient factors (robust choices, far from any tie)
FAST = Link(5e-3, 8e-11, "given: 100gbit@5ms")


def plan(link: Link, world: int = 2, **kw):
    return make_plan(LAYERS, world, PlanOptions(link=link, fusion_bytes=4 << 20, **kw))


def test_two_links_plan_differently_and_a_pinned_plan_keeps_its_own():
    """The premise of pinning: the probe decides the plan, and so the order of the sums."""
    slow, fast = plan(SLOW), plan(FAST)
    assert "sfb" in {s for _, s in slow.units} and len(fast.units) == 1
    pinned = pin_plan(slow.to_pb(), LAYERS, 2)
    assert pinned.units == slow.units
    assert [p.scheme for p in pinned.layers] == [p.scheme for p in slow.layers]
    assert pinned.nonce != slow.nonce  # each job names what it creates by its own nonce
    assert pinned.to_pb().world_size == 2 and pinned.link.alpha_s == SLOW.alpha_s


@pytest.mark.parametrize("change, why", [
    (lambda p: setattr(p, "world_size", 4), "made for 4 workers, this run has 2"),
    (lambda p: setattr(p, "slots", 2), "machines of 2 workers, this run's machines run 1"),
    (lambda p: setattr(p, "codec", "fp16"), "it sends fp16 gradients, this run fp32"),
    (lambda p: p.units[0].names.__setitem__(0, "fc9"), "its layer fc9 (index 5)"),
    (lambda p: p.units[0].layers.__setitem__(0, 4), "(index 4) is not a layer with parameters"),
    (lambda p: p.units.pop(), "it gives no scheme to"),
    (lambda p: setattr(p.units[-1], "scheme", "sfb"), "'sfb' cannot synchronise conv1"),
])
def test_a_plan_that_does_not_fit_is_refused_saying_why(change, why):
    recorded = plan(SLOW).to_pb()
    change(recorded)
    with pytest.raises(PlanMismatch, match=why.replace("(", r"\(").replace(")", r"\)")):
        pin_plan(recorded, LAYERS, 2)


def test_sfb_is_refused_where_iter_size_forbids_it():
    recorded = plan(SLOW).to_pb()
    assert any(u.scheme == "sfb" for u in recorded.units)
    with pytest.raises(PlanMismatch, match="cannot be synchronised by sfb"):
        pin_plan(recorded, LAYERS, 2, PlanOptions(allow_sfb=False))


def test_the_plan_file_round_trips_without_its_nonce(tmp_path):
    made = plan(SLOW).to_pb()
    path = tmp_path / "run_plan.prototxt"
    write_plan(path, made)
    text = path.read_text()
    assert text.startswith("# Poseidon communication plan") and "nonce" not in text
    assert 'names: "ip2"' in text and "world_size: 2" in text
    back = read_plan(path)
    made.ClearField("nonce")
    assert back == made and plan_text(back) == text


@pytest.mark.parametrize("h5", [False, True])
def test_a_snapshot_records_the_plan_and_a_plan_file_may_be_a_solverstate(h5, tmp_path):
    made = plan(SLOW).to_pb()
    state = caffe_pb2.SolverState(iter=5, learned_net="x.caffemodel",
                                  sync_state=made.SerializeToString())
    state.history.add().CopyFrom(array_to_blob(np.array([1.0, 2.0], np.float32)))
    path = tmp_path / ("s.solverstate.h5" if h5 else "s.solverstate")
    write_solverstate(path, state)
    assert read_solverstate(path).sync_state == state.sync_state
    assert recorded_plan(path) == made == read_plan(path)
    plain = caffe_pb2.SolverState(iter=5)
    write_solverstate(tmp_path / "p.solverstate", plain)
    assert recorded_plan(tmp_path / "p.solverstate") is None
    with pytest.raises(FormatError, match="records no communication plan"):
        read_plan(tmp_path / "p.solverstate")


@pytest.mark.parametrize("text, why", [("units { layers: 1 ", "not a Poseidon plan file"),
                                       ("comm: \"auto\"\n", "names its units and world_size")])
def test_a_bad_plan_file_is_one_line_naming_it(text, why, tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    with pytest.raises(FormatError, match=why) as e:
        read_plan(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_the_summary_and_the_reason_name_what_was_chosen():
    p = plan(SLOW)
    assert p.summary() == "; ".join(f"{'+'.join(n for l in ls for n in [LAYER_NAMES[l]])} {s}"
                                    for ls, s in p.units)
    assert "auto: the fastest scheme per layer" in p.why() and "0.10 Gbit/s" in p.why()
    assert plan(SLOW, comm="ring").why() == "--comm ring: wherever the layer allows it, else PS"
    many = make_plan([LayerInfo(i, f"l{i}", [(4,)]) for i in range(12)], 2,
                     PlanOptions(comm="ps", link=SLOW))
    assert many.summary().endswith("; and 4 more units")
    assert np.isfinite(p.layers[0].predicted_s)


LAYER_NAMES = {i.layer: i.name for i in LAYERS}
