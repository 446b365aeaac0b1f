"""The shared-memory scheme (engine/comm/schemes/shm.py): exact, bit-identical sums among the
workers of one machine, no gradient byte on a socket, its segment gone once a round is done, and
refused across machines.

The workers run as threads of this process with their own endpoints and syncers (the harness of
tests/test_comm_ring.py); the host table says they share one machine.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.comm.cost import LayerInfo
from engine.comm.planner import plan_layers
from engine.comm.schemes.shm import PARALLEL_BYTES, SHM_DIR, Shm, segment_path
from poseidon_cli.launch.hostfile import free_base_port, parse_hosts_text
from tests.test_comm_ring import SHAPES, exact_mean, run

pytestmark = pytest.mark.skipif(not Shm.available(), reason=f"needs a writable {SHM_DIR}")


def one_machine(n: int):
    return parse_hosts_text(f"127.0.0.1:{free_base_port(n)} slots={n}")


#: SHAPES (odd sizes, smaller than P, empty, two parameters) and one layer large enough to be
#: summed in P parts
BIG = {**SHAPES, 5: [(PARALLEL_BYTES // 4 + 13,)]}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shm_sum_is_exact_bit_identical_and_sends_no_gradient_bytes(world):
    res = run(world, "shm", rounds=3, shapes=BIG, hosts=one_machine(world),
              plan={"machines": 1}, fusion_bytes=0)
    for rnd in range(3):
        for l, arrays in exact_mean(world, rnd, BIG).items():
            got0 = res[0][0][(l, rnd)]
            for j, w in enumerate(arrays):
                np.testing.assert_allclose(got0[j], w, rtol=1e-5, atol=1e-6)
                for r in range(1, world):
                    assert np.array_equal(res[r][0][(l, rnd)][j], got0[j]), (r, l, j)
    for rank in range(world):
        assert {u.scheme for u in res[rank][2].values()} == {"shm"}
        for row in res[rank][1]["layers"]:  # the signals are headers: no array frame
            assert row["all_sent_per_iter"] == 0 and row["all_recv_per_iter"] == 0, row
    assert all(r[4].nonce == res[0][4].nonce for r in res.values())
    # the job's own segment: other test files' jobs (pytest-xdist) use the same folder
    assert not os.path.exists(segment_path(res[0][4].nonce)), "a segment outlived its job"


def test_shm_fuses_and_composes_with_the_sparse_codec():
    """One bucket of every layer; and the sparse codec's phases (norms, then values) each get a
    region: the sums equal the ring's, which tests/test_comm_ring.py checks exactly."""
    hosts = one_machine(3)
    fused = run(3, "shm", rounds=2, hosts=hosts, plan={"machines": 1}, fusion_bytes=1 << 20)
    assert len(fused[0][2]) == 1
    for rnd in range(2):
        for l, arrays in exact_mean(3, rnd).items():
            for j, w in enumerate(arrays):
                np.testing.assert_allclose(fused[1][0][(l, rnd)][j], w, rtol=1e-5, atol=1e-6)
    shapes = {0: [(4096,)], 1: [(300,)]}
    sparse = {"sparse": (0.25, 1, 0.0)}
    by_shm = run(3, "shm", rounds=3, shapes=shapes, wire="sparse", hosts=one_machine(3),
                 plan={"machines": 1, **sparse})
    by_ring = run(3, "ring", rounds=3, shapes=shapes, wire="sparse", chunk_bytes=1 << 20,
                  plan=sparse)
    for key, arrays in by_ring[0][0].items():
        for a, b in zip(arrays, by_shm[0][0][key]):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_the_planner_offers_shm_on_one_machine_only():
    fc = LayerInfo(0, "fc", [(1024, 1280), (1024,)], (32, 1280, 1024))
    [one] = plan_layers([fc], p1=4, machines=1)
    assert "shm" in one.timings and one.timings["shm"].bytes_sent == 0
    [many] = plan_layers([fc], p1=4)
    assert "shm" not in many.timings
    with pytest.raises(ValueError, match="one machine.*4 workers are on 2 machines"):
        plan_layers([fc], p1=4, comm="shm", machines=2)
    with pytest.raises(ValueError, match="one machine"):
        plan_layers([fc], p1=4, comm="auto,fc=shm", slots=2)
