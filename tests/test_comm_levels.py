"""Two levels: M machines of k workers reduce inside each machine first, then across machines.

Machines are hosts-file lines with slots=k on 127.0.0.1 (a machine is a line, not an address),
the workers threads of this process with their own endpoints, as in tests/test_comm_ring.py.
The sums must equal the flat sums' float64 reference and be bit-identical on every worker; the
bytes that cross between machines (the transport's counters) must be those of M workers, one
per machine, not k times that.
"""
from __future__ import annotations

import numpy as np
import pytest

from poseidon_cli.launch.hostfile import free_base_port, parse_hosts_text
from tests.test_comm_ring import SHAPES, run

K, M, N = 3, 6, 5
FC = {9: (K, M, N)}
SHAPES_FC = {**SHAPES, 9: [(N, M), (N,)]}


def machines(m: int, k: int):
    base = free_base_port(m * k)
    return parse_hosts_text("".join(f"127.0.0.1:{base + 2 * k * i} slots={k}\n"
                                    for i in range(m)))


def grads_fc(rank: int, rnd: int, shapes: dict) -> dict:
    rng = np.random.default_rng(7919 * rank + rnd)
    out = {l: [rng.standard_normal(s).astype(np.float32) for s in ss]
           for l, ss in shapes.items() if l not in FC}
    u = rng.standard_normal((K, N)).astype(np.float32)
    v = rng.standard_normal((K, M)).astype(np.float32)
    out[9] = [u.T @ v, u.sum(0)]
    out["factors"] = {9: (u, v)}
    return out


def exact(world: int, rnd: int) -> dict:
    gs = [grads_fc(r, rnd, SHAPES_FC) for r in range(world)]
    return {l: [np.sum([g[l][j].astype(np.float64) for g in gs], axis=0) / world
                for j in range(len(ss))] for l, ss in SHAPES_FC.items()}


def check(res: dict, world: int, rounds: int) -> None:
    for rnd in range(rounds):
        for l, arrays in exact(world, rnd).items():
            got0 = res[0][0][(l, rnd)]
            for j, w in enumerate(arrays):
                np.testing.assert_allclose(got0[j], w, rtol=1e-5, atol=1e-5)
                for r in range(1, world):
                    assert np.array_equal(res[r][0][(l, rnd)][j], got0[j]), (r, l, j)


@pytest.mark.parametrize("m, k", [(2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("comm", ["ring", "hd", "ps", "sfb"])
def test_two_levels_are_exact_and_bit_identical(m, k, comm):
    """Every scheme, the FC layer by SFB when comm is sfb (the rest by PS then)."""
    world = m * k
    res = run(world, comm, rounds=2, hosts=machines(m, k), shapes=SHAPES_FC,
              make_grads=grads_fc, factors=FC)
    check(res, world, 2)


def network_bytes(res: dict, world: int) -> float:
    """Bytes per iteration that crossed between machines, summed over every worker."""
    return sum(row["net_sent_per_iter"] for r in range(world) for row in res[r][1]["layers"])


@pytest.mark.parametrize("comm", ["ring", "sfb"])
def test_a_machine_sends_what_one_worker_with_k_times_the_batch_sends(comm):
    """2 machines x 3 workers (batch K each) against 2 machines x 1 worker with batch 3K:
    within 10% across machines (PS's shards are processes of their own and not counted here;
    tests/test_comm_sync.py checks the PS node formula)."""
    m, k = 2, 3
    two = run(m * k, comm, rounds=2, chunk_bytes=1 << 20, hosts=machines(m, k), shapes=SHAPES_FC,
              make_grads=grads_fc, factors=FC)
    flat = run(m * k, comm, rounds=2, chunk_bytes=1 << 20, hosts=machines(m, k),
               shapes=SHAPES_FC, make_grads=grads_fc, factors=FC, levels=False)
    # one worker per machine with k times the batch: K·k rows of factors
    single = run(m, comm, rounds=2, chunk_bytes=1 << 20, hosts=machines(m, 1), shapes=SHAPES_FC,
                 make_grads=lambda r, n, s: _big(r, n, k), factors={9: (K * k, M, N)})
    got, want = network_bytes(two, m * k), network_bytes(single, m)
    assert abs(got - want) <= 0.1 * want, (got, want)
    # flat, every worker is a node: SFB sends every worker's factors to every remote worker
    # (k times the rows to k times the peers); the ring in rank order crosses machines at 2 of
    # its 6 hops, but still carries 2(P-1)/P of every layer there instead of 2(M-1)/M
    assert network_bytes(flat, m * k) > (2.5 if comm == "sfb" else 1.5) * want
    check(two, m * k, 2)


def _big(rank: int, rnd: int, k: int) -> dict:
    rng = np.random.default_rng(rank + 1000 * rnd)
    out = {l: [rng.standard_normal(s).astype(np.float32) for s in ss]
           for l, ss in SHAPES_FC.items() if l != 9}
    u = rng.standard_normal((K * k, N)).astype(np.float32)
    v = rng.standard_normal((K * k, M)).astype(np.float32)
    out[9] = [u.T @ v, u.sum(0)]
    out["factors"] = {9: (u, v)}
    return out
