"""The planner: SACP's cost formulas and DESIGN.md's worked examples, the 3-way choice by
predicted time, forcing, fusion buckets, the plan on the wire, and the chunk table."""
from __future__ import annotations

import pytest

from engine.comm.cost import (
    Device,
    LayerInfo,
    cost_ps_node,
    cost_ps_worker,
    cost_ring,
    cost_sfb,
)
from engine.comm.fusion import buckets
from engine.comm.link import Link
from engine.comm.planner import PlanOptions, make_plan, plan_layers, plan_table
from engine.comm.chunks import PSParam, make_layout


def fc(name, m, n, k, bias=False):
    shapes = [(n, m)] + ([(n,)] if bias else [])
    return LayerInfo(0, name, shapes, factors=(k, m, n))


def test_vgg_fc6_prefers_sfb():
    [p] = plan_layers([fc("fc6", 25088, 4096, 32)], p1=8, comm="hybrid")
    assert round(p.ps_bytes / 1e6) == 1439
    assert round(p.sfb_bytes / 1e6) == 52
    assert p.scheme == "sfb" and p.bytes_per_node == p.sfb_bytes
    assert p.timings["sfb"].bytes_sent + p.timings["sfb"].bytes_received == p.sfb_bytes


def test_vgg_fc8_prefers_ps():
    [p] = plan_layers([fc("fc8", 4096, 1000, 256)], p1=8, comm="hybrid")
    assert round(p.ps_bytes / 1e6) == 57
    assert round(p.sfb_bytes / 1e6) == 73
    assert p.scheme == "ps"


def test_formulas():
    assert cost_ps_worker(10) == 20
    assert cost_ps_node(10, 4, 4) == 2 * 10 * 6 / 4
    assert cost_ps_node(10, 4, 1) == 2 * 10 * 3  # one server node serves everybody
    assert cost_sfb(3, 5, 2, 4) == 2 * 2 * 3 * 8
    assert cost_ring(10, 4) == 4 * 10 * 3 / 4


def test_forcing_and_layers_without_factors():
    conv = LayerInfo(1, "conv1", [(20, 1, 5, 5), (20,)])
    plans = plan_layers([fc("fc6", 25088, 4096, 32), conv], p1=8, comm="ps")
    assert [p.scheme for p in plans] == ["ps", "ps"]
    plans = plan_layers([fc("fc8", 4096, 1000, 256), conv], p1=8, comm="sfb")
    assert [p.scheme for p in plans] == ["sfb", "ps"]
    plans = plan_layers([fc("fc6", 25088, 4096, 32)], p1=8, allow_sfb=False)
    assert plans[0].scheme == "ps"
    plans = plan_layers([fc("fc8", 4096, 1000, 256), conv], p1=8, comm="ring")
    assert [p.scheme for p in plans] == ["ring", "ring"]
    with pytest.raises(ValueError, match="--comm"):
        plan_layers([conv], p1=2, comm="allgather")


def test_plan_table_lists_every_layer():
    plans = plan_layers([fc("fc6", 25088, 4096, 32, bias=True), fc("fc8", 4096, 1000, 256)], p1=8,
                        comm="hybrid")
    text = plan_table(plans, 8)
    assert "fc6" in text and "4096x25088 + 4096" in text and "sfb" in text
    assert "fc8" in text and " ps " in text


def test_layout_balances_bytes_and_respects_chunk_size():
    params = [PSParam(0, 0, 1_000_000, "<f4"), PSParam(1, 0, 1000, "<f4"), PSParam(2, 1, 3_000_000, "<f4")]
    layout = make_layout(params, 3, chunk_bytes=1 << 20)
    assert all(c.count * 4 <= 1 << 20 for c in layout)
    for p in params:  # chunks tile each parameter exactly
        cs = [c for c in layout if c.param == p.index]
        assert [c.chunk for c in cs] == list(range(len(cs)))
        assert cs[0].offset == 0 and sum(c.count for c in cs) == p.count
        assert all(a.offset + a.count == b.offset for a, b in zip(cs, cs[1:]))
    load = [sum(c.count for c in layout if c.shard == s) for s in range(3)]
    assert max(load) - min(load) <= 262144  # within one chunk
    assert make_layout(params, 3, 1 << 20) == layout  # deterministic


TEN_GBE = Link.from_bandwidth(10e9, 50e-6)


def test_auto_takes_the_fastest_scheme_per_layer():
    """auto compares predicted times: SFB for a wide FC layer with a small batch, a dense
    scheme (PS, ring, halving-doubling) for a conv layer (no factors), and never a scheme slower than another that applies."""
    conv = LayerInfo(1, "conv", [(256, 256, 3, 3), (256,)])
    plans = plan_layers([fc("fc6", 25088, 4096, 32), conv], p1=8, link=TEN_GBE)
    assert plans[0].scheme == "sfb" and plans[1].scheme in ("ps", "ring", "hd")
    for p in plans:
        assert p.predicted_s == min(t.total_s for t in p.timings.values())
        assert set(p.timings) >= {"ps", "ring"}


def test_sfb_rebuild_cost_can_make_sfb_lose():
    """On a slow CPU the rebuild GEMM (2·P·K·M·N flops) outweighs the bytes SFB saves."""
    layer = fc("fc", 4096, 4096, 256)
    fast = plan_layers([layer], p1=8, link=TEN_GBE, device=Device(gemm_flops_per_s=5e12))[0]
    slow = plan_layers([layer], p1=8, link=TEN_GBE, device=Device(gemm_flops_per_s=1e9))[0]
    assert slow.timings["sfb"].total_s > fast.timings["sfb"].total_s + 10
    assert slow.scheme != "sfb"


def test_ring_bytes_are_two_p_minus_one_over_p():
    for p in (2, 3, 5, 8):
        [plan] = plan_layers([LayerInfo(0, "c", [(1000, 10)])], p1=p, comm="ring")
        t = plan.timings["ring"]
        assert t.bytes_sent == t.bytes_received == pytest.approx(2 * (p - 1) / p * 40000)


def test_fusion_buckets_consecutive_dense_layers_by_size_and_wait():
    # (layer, scheme, bytes, dense): released top-down 5, 4, 3, 2, 1
    layers = [(1, "ring", 100, True), (2, "ring", 100, True), (3, "sfb", 50, False),
              (4, "ring", 300, True), (5, "ring", 100, True)]
    assert buckets(layers, 0) == [([5], "ring"), ([4], "ring"), ([3], "sfb"), ([2], "ring"),
                                  ([1], "ring")]
    assert buckets(layers, 400) == [([5, 4], "ring"), ([3], "sfb"), ([2, 1], "ring")]
    assert buckets(layers, 300) == [([5], "ring"), ([4], "ring"), ([3], "sfb"), ([2, 1], "ring")]
    # layer 1's release comes 0.01 s after layer 2's: over a 5 ms limit, so not fused
    backward = [0.0, 0.01, 0.0, 0.0, 0.0, 0.0]
    assert buckets(layers, 400, 0.005, backward)[-2:] == [([2], "ring"), ([1], "ring")]
    assert buckets(layers, 400, 0.05, backward)[-1] == ([2, 1], "ring")


def test_plan_travels_as_protobuf_and_prints_its_predictions():
    conv = LayerInfo(1, "conv1", [(20, 1, 5, 5), (20,)])
    conv2 = LayerInfo(2, "conv2", [(50, 20, 5, 5), (50,)])
    fc3 = LayerInfo(3, "fc", [(500, 800)], (64, 800, 500))
    plan = make_plan([conv, conv2, fc3], 4, PlanOptions(comm="ring", link=TEN_GBE,
                                                         fusion_bytes=1 << 21, codec="fp16"))
    msg = plan.to_pb()
    assert [(list(u.layers), u.scheme) for u in msg.units] == [([3, 2, 1], "ring")]
    assert msg.codec == "fp16" and msg.alpha_s == pytest.approx(50e-6)
    text = plan_table(plan, 4)
    assert "fused fc+conv2+conv1 (ring)" in text and "wire fp16" in text and " ms" in text


def test_auto_gives_a_run_of_small_layers_one_dense_scheme():
    """bench train's conv net (four small layers, 66 K parameters): per layer PS and ring are
    within a hair of each other on a band of links, and a plan of both paid two rounds (0.81x
    DDP against 0.96-1.01x for either alone, 1 Gbit/s). With fusion priced in, auto plans one
    scheme and one bucket on every link of the grid; without fusion it may mix."""
    conv = [LayerInfo(1, "conv1", [(32, 1, 3, 3), (32,)]), LayerInfo(3, "conv2", [(64, 32, 3, 3), (64,)]),
            LayerInfo(6, "conv3", [(64, 64, 3, 3), (64,)]), LayerInfo(8, "ip", [(10, 1024), (10,)], (32, 1024, 10))]
    device = Device(update_bytes_per_s=100e9, gemm_flops_per_s=150e9, add_bytes_per_s=100e9,
                    update_on_device=False)
    mixed_unfused = 0
    for alpha_us in range(50, 400, 10):
        for gbit in (0.8, 1.0, 1.2, 1.5, 2.0, 5.0, 10.0):
            link = Link(alpha_us * 1e-6, 8 / (gbit * 1e9), "grid")
            plan = make_plan(conv, 4, PlanOptions(link=link, device=device, fusion_bytes=4 << 20))
            assert len(plan.units) == 1, (alpha_us, gbit, [(p.info.name, p.scheme) for p in plan.layers])
            unfused = make_plan(conv, 4, PlanOptions(link=link, device=device))
            mixed_unfused += len({p.scheme for p in unfused.layers}) > 1
    assert mixed_unfused > 0  # the grid does reach the links where per-layer choices differ


# ------------------------------------------------- a busy-waiting engine carries all or none
ENGINE_NET = [LayerInfo(1, "conv1", [(8, 1, 3, 3), (8,)]),
              LayerInfo(3, "ip1", [(256, 512), (256,)], factors=(16, 512, 256)),
              LayerInfo(5, "ip2", [(10, 256), (10,)], factors=(16, 256, 10))]
SLOW = Link(5e-3, 8e-8, "given: 100mbit@5ms")


def engine_plan(name: str, beta: float) -> list:
    from engine.comm.engines import EngineCost
    return plan_layers(ENGINE_NET, 2, link=SLOW,
                       engines=(EngineCost(name, "v1", "ring", Link(1e-5, beta, "a probe")),))


def cheapest(p, allowed=lambda s: True) -> str:
    return min((s for s in p.timings if allowed(s)), key=lambda s: p.timings[s].total_s)


@pytest.mark.parametrize("beta, alone", [(1e-6, "none"), (2e-8, "all")])
def test_auto_gives_mpi_every_layer_or_none_whichever_costs_less(beta, alone):
    """Each layer's cheapest scheme would mix MPI (the small layers) with SFB (ip1): MPI's calls
    busy-wait beside the other schemes' traffic, so auto compares MPI on every layer with the
    cheapest plan without it. Gloo, which sleeps while it waits, keeps the per-layer mix."""
    plans = engine_plan("mpi", beta)
    mixed = {cheapest(p) for p in plans}
    assert "mpi" in mixed and len(mixed) > 1  # per layer, the mix (the pass has work)
    without = sum(p.timings[cheapest(p, lambda s: s != "mpi")].total_s for p in plans)
    every = sum(p.timings["mpi"].total_s for p in plans)
    assert (every < without) == (alone == "all")
    chosen = [p.scheme for p in plans]
    if alone == "all":
        assert chosen == ["mpi"] * 3
        assert all("mpi on every layer" in p.reason for p in plans if cheapest(p) != "mpi")
    else:
        assert chosen == [cheapest(p, lambda s: s != "mpi") for p in plans]
        assert "mpi" not in chosen and any("busy-waits" in p.reason for p in plans)
    gloo = engine_plan("gloo", beta)
    assert [p.scheme for p in gloo] == [cheapest(p) for p in gloo]
    assert {p.scheme for p in gloo} == {s.replace("mpi", "gloo") for s in mixed}


def test_a_layer_given_by_name_keeps_its_scheme_and_mpi_then_carries_none():
    from engine.comm.engines import EngineCost
    plans = plan_layers(ENGINE_NET, 2, comm="auto,ip1=sfb", link=SLOW, engines=(
        EngineCost("mpi", "v1", "ring", Link(1e-5, 2e-8, "a probe")),))
    assert [p.scheme for p in plans][1] == "sfb" and "mpi" not in {p.scheme for p in plans}


def _bench_fc_net() -> list[LayerInfo]:
    """bench train's FC-heavy net (poseidon_cli/benches/train.py), batch 32 per worker."""
    return [LayerInfo(1, "conv1", [(20, 1, 3, 3), (20,)]),
            LayerInfo(3, "ip1", [(1024, 1280), (1024,)], factors=(32, 1024, 1280)),
            LayerInfo(5, "ip2", [(10, 1024), (10,)], factors=(32, 10, 1024))]


def test_a_crowded_machine_prices_each_messages_cpu_as_compute_taken_from_its_workers():
    """More workers than cores: a message's overhead at each end (the link's, probed) times
    the workers per core is added to every scheme of Poseidon's transport, by its messages a
    round; with cores to spare nothing is. On the FC-heavy bench net through 1 Gbit/s
    (4 workers, 2 cores: measured, ip2 ran 0.95 as fast on hd as on PS, the plan that priced
    hd cheaper on the wire alone), ip2 moves from hd to PS; the engines' own messages are
    not Poseidon's to price."""
    from engine.comm.engines import EngineCost

    link = Link(140e-6, 8e-9 / 1.17, "probed", overhead_s=80e-6)
    device = Device("cpu", update_bytes_per_s=8e9, gemm_flops_per_s=50e9, add_bytes_per_s=8e9,
                    update_on_device=False)
    engines = (EngineCost("gloo", "torch", "ring", Link(300e-6, 8e-9, "gloo probe")),)
    free = plan_layers(_bench_fc_net(), 4, "auto", link=link, device=device, engines=engines)
    crowded = plan_layers(_bench_fc_net(), 4, "auto", link=link, device=device,
                          engines=engines, crowding=2.0)
    for f, c in zip(free, crowded):
        for name, t in c.timings.items():
            base = f.timings[name]
            assert base.cpu_s == 0.0
            own = t.reduce_s - t.update_s  # its sums and rebuilds: on a shared core, twice
            assert t.cpu_s == pytest.approx(2.0 * 80e-6 * t.messages + own)
            assert t.total_s == pytest.approx(base.total_s + t.cpu_s)
        assert c.timings["gloo"].messages == 0 and c.timings["gloo"].cpu_s == 0
    # SFB's rebuild is the CPU that counts most: ip1's 1024x1280 from 4 workers' factors
    ip1 = {p.info.name: p for p in crowded}["ip1"].timings["sfb"]
    assert ip1.reduce_s - ip1.update_s > 0.5 * ip1.cpu_s > 0
    assert {p.info.name: p.scheme for p in free}["ip2"] == "hd"
    assert {p.info.name: p.scheme for p in crowded} == {"conv1": "ps", "ip1": "sfb",
                                                         "ip2": "ps"}
    # one worker a core: priced as before; a link with no overhead probed: the sums alone
    same = plan_layers(_bench_fc_net(), 4, "auto", link=link, device=device, engines=engines,
                       crowding=1.0)
    assert all(t.cpu_s == 0 for p in same for t in p.timings.values())
    assert [p.scheme for p in same] == [p.scheme for p in free]
    quiet = plan_layers(_bench_fc_net(), 4, "auto", link=Link(140e-6, 8e-9 / 1.17),
                        device=device, engines=engines, crowding=2.0)
    assert all(t.cpu_s == pytest.approx(t.reduce_s - t.update_s)
               for p in quiet for t in p.timings.values())


def test_crowding_counts_the_workers_of_ones_own_kernel_per_core():
    from engine.comm.topology import crowding

    a, b = b"kernel a", b"kernel b"
    assert crowding(a, 2, [a, a, b, a, a]) == 2.0
    assert crowding(b, 8, [a, a, b, a, a]) == 0.125
