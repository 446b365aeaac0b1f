"""SACP planner: the cost formulas, DESIGN.md's worked examples, forcing, and the chunk table."""
from __future__ import annotations

import pytest

from engine.comm.planner import (LayerInfo, cost_ps_node, cost_ps_worker, cost_ring, cost_sfb,
                                 plan_layers, plan_table)
from engine.comm.ps import PSParam, make_layout


def fc(name, m, n, k, bias=False):
    shapes = [(n, m)] + ([(n,)] if bias else [])
    return LayerInfo(0, name, shapes, factors=(k, m, n))


def test_vgg_fc6_prefers_sfb():
    [p] = plan_layers([fc("fc6", 25088, 4096, 32)], p1=8)
    assert round(p.ps_bytes / 1e6) == 1439
    assert round(p.sfb_bytes / 1e6) == 52
    assert p.scheme == "sfb" and p.bytes_per_node == p.sfb_bytes


def test_vgg_fc8_prefers_ps():
    [p] = plan_layers([fc("fc8", 4096, 1000, 256)], p1=8)
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
    with pytest.raises(ValueError, match="--comm"):
        plan_layers([conv], p1=2, comm="ring")


def test_plan_table_lists_every_layer():
    plans = plan_layers([fc("fc6", 25088, 4096, 32, bias=True), fc("fc8", 4096, 1000, 256)], p1=8)
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
