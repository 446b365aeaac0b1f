"""The DAG model (engine/perf/dag.py) on small DAGs whose answer is worked out by hand, its
byte counts against the planner's cost formulas, and the net facts against a built Net."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from engine.comm.cost import LayerInfo, cost_ps_node, cost_sfb
from engine.comm.link import Link, LinkError, load_link, parse_bandwidth, parse_duration
from engine.perf.dag import Device, predict, sweep
from engine.perf.flops import TITAN_X, trace_from_flops
from engine.perf.netinfo import LayerFacts, NetInfo, net_info
from engine.perf.trace import LayerTime, Trace, TraceError, load_trace
from tests.conftest import ROOT

#: costs outside the trace switched off, so the hand computations see only the link
FREE = Device("free", update_bytes_per_s=1e30, gemm_flops_per_s=1e30, add_bytes_per_s=1e30)
MS = 1e-3


def net(*layers: tuple[str, float, float, int]) -> tuple[NetInfo, Trace]:
    """Layers (name, forward ms, backward ms, parameter count; 0 = none) in forward order;
    each parameter is one float vector, small enough to be one PS chunk."""
    facts = [LayerFacts(i, name, "X", 0, 0, 0) for i, (name, *_rest) in enumerate(layers)]
    params = [LayerInfo(i, name, [(n,)]) for i, (name, _, _, n) in enumerate(layers) if n]
    trace = Trace("hand", 1, [LayerTime(name, "X", f, b) for name, f, b, _ in layers])
    return NetInfo("hand", 1, facts, params), trace


def link_ms_per_float(ms: float) -> Link:
    """A link that moves one float (4 bytes) in ``ms`` milliseconds, with no latency."""
    return Link(0.0, ms * MS / 4)


def test_communication_fully_hidden_behind_backward():
    # L0 (no params) fwd 1 bwd 5; L1 (1000 floats) fwd 1 bwd 1.
    # Backward: L1 ends at 2 + 1 = 3 and is released; with P = 2 and one chunk, the busiest
    # node sends the chunk once (push, or the sum to the other worker): 1000 floats, plus the
    # same again because a chunk's sum waits for its push: 2 x 1000 x 0.0015 ms = 3 ms, so
    # the update is applied at 6. L0's backward ends at 3 + 5 = 8, the next forward of L1
    # starts at 8 + 1 = 9 > 6: nothing waits. Period 8 ms = compute.
    info, trace = net(("L0", 1, 5, 0), ("L1", 1, 1, 1000))
    p = predict(info, trace, 2, "ps", link_ms_per_float(0.0015), FREE)
    assert p.compute_s == pytest.approx(8 * MS)
    assert p.iteration_s == pytest.approx(8 * MS)
    assert p.exposed_comm_s == pytest.approx(0.0, abs=1e-12)


def test_communication_hidden_by_the_next_forward_too():
    # L0 (no params) fwd 1 bwd 1; L1 (1000 floats) fwd 1 bwd 1; 2 x 1000 x 0.00075 = 1.5 ms.
    # L1 released at 3, applied at 4.5. Backward ends at 4; the next L0 forward runs 4..5 and
    # L1's forward needs its update only at 5: per-layer waiting hides it. Period 4 ms.
    info, trace = net(("L0", 1, 1, 0), ("L1", 1, 1, 1000))
    p = predict(info, trace, 2, "ps", link_ms_per_float(0.00075), FREE)
    assert p.iteration_s == pytest.approx(4 * MS)


def test_communication_not_hidden():
    # L0 (2000 floats) fwd 1 bwd 4; L1 (none) fwd 1 bwd 1; L2 (1000 floats) fwd 1 bwd 2.
    # 0.0005 ms per float: L2 takes 2 x 1000 x 0.0005 = 1 ms, L0 takes 2 x 2000 x 0.0005 = 2.
    # Backward from 3: L2 ends and is released at 5 (link 5..6), L1 at 6, L0 at 10 (link
    # 10..12). The next iteration's first forward (L0) waits for its update: it starts at 12.
    # DESIGN.md's recurrence: tau_c(1) + t_c(1) - (tau_b(1) + t_b(1)) = 12 - 10 = 2 exposed.
    info, trace = net(("L0", 1, 4, 2000), ("L1", 1, 1, 0), ("L2", 1, 2, 1000))
    p = predict(info, trace, 2, "ps", link_ms_per_float(0.0005), FREE)
    assert p.compute_s == pytest.approx(10 * MS)
    assert p.iteration_s == pytest.approx(12 * MS)
    assert p.exposed_comm_s == pytest.approx(2 * MS)
    assert p.images_per_s == pytest.approx(2 / (12 * MS))


def test_link_is_one_queue_per_direction_in_release_order():
    # The same net on a slower link, 0.003 ms per float. L2 (1000 floats), released at 5: its
    # push leaves 5..8, its sum comes back 8..11. L0 (2000 floats), released at 10: the sending
    # side is free, push 10..16; the receiving side is free from 11, but L0's sum can only
    # follow its push (one chunk): 16..22. The next iteration starts at 22. (One shared link
    # would have made it 23: L0's push would have queued behind L2's sum.)
    info, trace = net(("L0", 1, 4, 2000), ("L1", 1, 1, 0), ("L2", 1, 2, 1000))
    p = predict(info, trace, 2, "ps", link_ms_per_float(0.003), FREE)
    assert p.iteration_s == pytest.approx(22 * MS)


def test_many_small_layers_pipeline_across_directions():
    # Three single-chunk layers of 1000 floats, forward 1 ms and backward 2 ms each, 0.001 ms
    # per float each way. Backward from 3 releases C at 5, B at 7, A at 9: pushes 5..6, 7..8,
    # 9..10 and sums 6..7, 8..9, 10..11. All is hidden behind backward but A's round trip:
    # A's next forward starts at 11.
    info, trace = net(("A", 1, 2, 1000), ("B", 1, 2, 1000), ("C", 1, 2, 1000))
    p = predict(info, trace, 2, "ps", link_ms_per_float(0.001), FREE)
    assert p.iteration_s == pytest.approx(11 * MS)


def test_one_worker_is_compute_plus_update():
    info, trace = net(("L0", 1, 4, 2000), ("L1", 2, 3, 0))
    dev = Device("slow update", update_bytes_per_s=4000 * 5.0 * 4 / (1 * MS))  # 2000 floats: 0.5 ms
    p = predict(info, trace, 1, "hybrid", Link(1.0, 1.0), dev)
    assert p.iteration_s == pytest.approx(10 * MS + 0.5 * MS)
    # nothing is sent: what is exposed beyond compute is the update alone (the columns add up)
    assert p.exposed_comm_s == pytest.approx(0.5 * MS)


def test_bytes_per_node_follow_the_cost_model():
    k, m, n, p = 32, 6272, 1024, 8
    fc = LayerInfo(1, "fc", [(n, m), (n,)], factors=(k, m, n))
    facts = [LayerFacts(0, "data", "Input", 0, 0, 0), LayerFacts(1, "fc", "InnerProduct", 0, 0, 0)]
    info = NetInfo("fc", k, facts, [fc])
    trace = Trace("fc", k, [LayerTime("data", "Input", 0, 0), LayerTime("fc", "InnerProduct", 1, 2)])
    sfb = predict(info, trace, p, "sfb", Link.from_bandwidth(1e9), FREE)
    # SFB sends K rows of u (N wide) and v (M wide) to, and gets them from, each of P-1 peers;
    # the bias rides along in u
    assert sfb.bytes_per_node == 4 * cost_sfb(m, n, k, p)
    # PS with a balanced layout (P equal chunks of each parameter... the bias is one chunk on
    # one shard, so compare the weight alone)
    w_only = NetInfo("fc", k, facts, [LayerInfo(1, "fc", [(8 * 65536,)])])
    ps = predict(w_only, trace, p, "ps", Link.from_bandwidth(1e9), FREE)
    assert ps.bytes_per_node == 4 * cost_ps_node(8 * 65536, p, p)


def test_sweep_speedup_and_efficiency_and_hybrid_choice():
    info = net_info(ROOT / "models" / "vgg19_22k_s4" / "train_val.prototxt")
    trace = trace_from_flops(info, TITAN_X)
    rows = sweep(info, trace, [1, 2, 4, 8], ["ps", "hybrid"], Link.from_bandwidth(10e9, 50e-6))
    by = {(r.scheme, r.workers): r for r in rows}
    for s in ("ps", "hybrid"):
        assert by[(s, 1)].speedup == 1.0
        for p in (2, 4, 8):
            r = by[(s, p)]
            assert r.speedup == pytest.approx(r.images_per_s / by[(s, 1)].images_per_s)
            assert r.efficiency == pytest.approx(r.speedup / p)
            assert r.iteration_s >= r.compute_s * (1 - 1e-12)
    # the FC-heavy net: hybrid never slower than PS, and far faster at 8 workers (1.49x on a
    # fair link: PS's 100 MB each way on the busiest node's link against SFB's few)
    for p in (2, 4, 8):
        assert by[("hybrid", p)].iteration_s <= by[("ps", p)].iteration_s
    assert by[("hybrid", 8)].images_per_s >= 1.4 * by[("ps", 8)].images_per_s


@pytest.mark.parametrize("model, shape", [("lenet", (1, 28, 28)), ("cifar10_quick", (3, 32, 32))])
def test_net_facts_equal_a_built_net(model, shape):
    from engine.comm.bind import describe_net
    from engine.net import Net
    from engine.perf.netinfo import read_train_net, with_inputs

    info = net_info(ROOT / "models" / model / "train_val.prototxt", input_shape=shape)
    param, batch = with_inputs(read_train_net(ROOT / "models" / model / "train_val.prototxt"),
                               input_shape=shape)
    built = Net(param, phase="TRAIN")  # with its fillers, as training builds it
    _, infos = describe_net(built)
    assert [(i.name, i.shapes, i.factors) for i in info.params] == \
        [(i.name, i.shapes, i.factors) for i in infos]
    assert [l.name for l in info.layers] == built.layer_names
    assert info.total_params == sum(int(np.prod(b.shape)) for b in built.learnable_params)
    conv1 = info.by_name()["conv1"]
    w = built.params["conv1"][0].shape
    top = built.blobs["conv1"].data.shape
    assert conv1.macs == int(np.prod(top)) * int(np.prod(w[1:]))


def test_vgg19_22k_facts_without_its_memory():
    start = time.monotonic()
    info = net_info(ROOT / "models" / "vgg19_22k" / "train_val.prototxt")
    assert time.monotonic() - start < 30
    assert info.total_params == 229_052_817 and info.batch == 32
    fc = {i.name: i.factors for i in info.params if i.factors}
    assert fc == {"fc6": (32, 25088, 4096), "fc7": (32, 4096, 4096), "fc8_22k": (32, 4096, 21841)}


def test_trace_and_link_files_are_checked(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "poseidon-layer-trace", "version": 2, "layers": []}')
    with pytest.raises(TraceError, match="version 2"):
        load_trace(bad)
    bad.write_text('{"layers": [{"name": "a", "forward_ms": -1, "backward_ms": 0}]}')
    with pytest.raises(TraceError, match=r"layers\[0\] \(a\): negative"):
        load_trace(bad)
    bad.write_text("{")
    with pytest.raises(TraceError, match="not JSON"):
        load_trace(bad)
    t = Trace("n", 4, [LayerTime("a", "X", 1.5, 2.5)], "dev", "src")
    t.save(tmp_path / "ok.json")
    back = load_trace(tmp_path / "ok.json")
    assert back.layers == t.layers and back.batch == 4 and json.loads(
        (tmp_path / "ok.json").read_text())["version"] == 1
    link = Link(1e-4, 1e-9, "fitted", unfair=0.2, overhead_s=8e-5)
    link.save(tmp_path / "link.json")
    assert load_link(tmp_path / "link.json") == link
    bad.write_text('{"format": "poseidon-link", "version": 1, "alpha_s": 0, '
                   '"beta_s_per_byte": 1e-9, "unfair": -1}')
    with pytest.raises(LinkError, match="unfair must be >= 0"):
        load_link(bad)
    bad.write_text('{"format": "poseidon-link", "version": 1, "alpha_s": 0, '
                   '"beta_s_per_byte": 1e-9, "overhead_s": -1e-5}')
    with pytest.raises(LinkError, match="overhead_s must be >= 0, got -1e-05"):
        load_link(bad)
    assert parse_bandwidth("10GbE") == parse_bandwidth("10gbit") == 1e10
    assert parse_bandwidth("1.25GB/s") == 1e10
    assert parse_duration("50us") == pytest.approx(50e-6)
    with pytest.raises(LinkError):
        parse_bandwidth("fast")


def test_shapes_are_inferred_without_allocating_activations():
    """VGG-19-22K at batch 4096: its activations and gradients alone are some 600 GB, its
    parameters 0.9 GB; the facts come from blobs that hold no memory (tracemalloc sees every
    NumPy allocation, so a single real blob of either kind would show here)."""
    import tracemalloc

    tracemalloc.start()
    try:
        info = net_info(ROOT / "models" / "vgg19_22k" / "train_val.prototxt", batch=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.batch == 4096 and info.total_params == 229_052_817
    conv1 = info.by_name()["conv1_1"]
    assert conv1.top_bytes == 4096 * 64 * 224 * 224 * 4  # the shape is still the real one
    assert dict((i.name, i.factors) for i in info.params if i.factors)["fc6"] == (4096, 25088, 4096)
    assert peak < 64 << 20, peak  # the prototxt, the layer objects, the plan: not one blob
