"""Coarse-grained sparse communication (engine/comm/codecs/sparse.py) and its momentum correction.

In-process workers (tests/test_comm_ring.py's harness) check the protocol against a float64
re-enactment of it: the same chunks everywhere, the top ones by the summed L1 norms, residuals
that lose exactly what was sent, dense warm-up rounds, the byte counters, bit-identical
replicas, for P = 2 and 3 over ring and PS. A one-worker sync that keeps the momentum checks the
Solver's side of the correction, and `poseidon train -n 2` runs it all end to end.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from engine.comm.codecs import SparseCodec, make_codec
from engine.comm.cost import LayerInfo
from engine.comm.planner import PlanOptions, make_plan, plan_table
from engine.solver import Solver
from engine.solvers import SolverError
from poseidon_cli.job_config import JobConfig
from poseidon_cli.main import cli
from tests.test_comm_ring import grads, run
from tests.test_comm_train import (  # noqa: F401
    BOUND,
    ITERS,
    TOTAL_BATCH,
    digits_db,
    poseidon,
    weights,
    write_hosts,
    write_run,
)
from tests.test_train import InlineSync, params, tiny, train, write_solver  # noqa: F401

C = SparseCodec.CHUNK
RATIO = 0.1
#: 418 values: 2 chunks, 1 sent (the short last chunk included); 3 and 35 values: too small to
#: be sparse; an empty layer; 3,000 values: 12 chunks, 2 sent; 4,040 values: 16 chunks, 2 sent
SHAPES = {0: [(37, 11), (11,)], 1: [(3,)], 2: [(0,)], 3: [(3000,)], 4: [(40, 100), (40,)],
          5: [(5, 7)]}


def count(layer: int) -> int:
    return sum(math.prod(s) for s in SHAPES[layer])


def geometry(n: int) -> tuple[int, int | None]:
    """(chunks, chunks sent) as the protocol defines them; None: every round dense."""
    chunks = math.ceil(n / C)
    k = math.ceil(RATIO * chunks)
    return chunks, (k if k * C + chunks < n else None)


def flat_grads(rank: int, rnd: int) -> dict[int, np.ndarray]:
    """A layer's gradients as the unit's vector: its params' values, one after the other."""
    return {l: np.concatenate([a.ravel() for a in arrays]).astype(np.float64)
            for l, arrays in grads(rank, rnd, SHAPES).items()}


def reenact(world: int, rounds: int, warmup: int, momentum: float) -> dict:
    """The protocol in float64: each round's mean per layer, the chunks it sent (None: all),
    every worker's final residual, and the sum over rounds and workers of what was folded in
    (the gradients, or the velocities with momentum correction)."""
    v = {(r, l): np.zeros(geometry(count(l))[0] * C) for r in range(world) for l in SHAPES}
    u = {(r, l): np.zeros(count(l)) for r in range(world) for l in SHAPES}
    folded = {l: np.zeros(count(l)) for l in SHAPES}
    means, sent = {}, {}
    for rnd in range(rounds):
        g = [flat_grads(r, rnd) for r in range(world)]
        for l in SHAPES:
            n = count(l)
            chunks, k = geometry(n)
            for r in range(world):
                u[(r, l)] = momentum * u[(r, l)] + g[r][l]
                v[(r, l)][:n] += u[(r, l)]
                folded[l] += u[(r, l)]
            if k is None or rnd < warmup:
                means[(l, rnd)] = sum(v[(r, l)][:n] for r in range(world)) / world
                sent[(l, rnd)] = None
                for r in range(world):
                    v[(r, l)][:] = 0
                continue
            norms = sum(np.abs(v[(r, l)]).reshape(chunks, C).sum(axis=1) for r in range(world))
            order = np.argsort(-norms, kind="stable")
            top, rest = norms[order[k - 1]], norms[order[k]]
            # float32 sums of these norms cannot order the chosen chunks differently
            assert top - rest > 1e-4 * top, (l, rnd, top, rest)
            picked = np.sort(order[:k])
            mean = np.zeros(chunks * C)
            for r in range(world):
                rows = v[(r, l)].reshape(chunks, C)
                mean.reshape(chunks, C)[picked] += rows[picked]
                rows[picked] = 0
            means[(l, rnd)] = mean[:n] / world
            sent[(l, rnd)] = picked
    residuals = {(r, l): v[(r, l)][:count(l)] for r in range(world) for l in SHAPES}
    return {"means": means, "sent": sent, "residuals": residuals, "folded": folded}


def sparse_run(world: int, comm: str, rounds: int, warmup: int, momentum: float) -> dict:
    return run(world, comm, rounds=rounds, chunk_bytes=1 << 20, wire="sparse", shapes=SHAPES,
               plan=dict(sparse=(RATIO, warmup, momentum)))


def applied(res: dict, rank: int, layer: int, rnd: int) -> np.ndarray:
    """The mean gradient the update of ``layer`` saw in round ``rnd``, as one vector."""
    return np.concatenate([a.ravel() for a in res[rank][0][(layer, rnd)]])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("comm", ["ring", "hd", "ps"])
@pytest.mark.parametrize("world", [2, 3])
def test_sparse_rounds_send_the_top_chunks_and_keep_the_rest(world, comm, momentum):
    rounds, warmup = 4, 1
    res = sparse_run(world, comm, rounds, warmup, momentum)
    want = reenact(world, rounds, warmup, momentum)
    for l in SHAPES:
        n = count(l)
        total = np.zeros(n)
        for rnd in range(rounds):
            got = applied(res, 0, l, rnd)
            for r in range(1, world):  # every worker took the same chunks and the same sums
                assert np.array_equal(applied(res, r, l, rnd), got), (r, l, rnd)
            mean = want["means"][(l, rnd)]
            scale = max(1.0, float(np.abs(mean).max(initial=0)))
            np.testing.assert_allclose(got, mean, rtol=0, atol=1e-5 * scale)
            picked = want["sent"][(l, rnd)]
            if picked is not None:  # exactly zero outside the chosen chunks
                outside = np.ones(math.ceil(n / C) * C, bool)
                outside.reshape(-1, C)[picked] = False
                assert not got[outside[:n]].any(), (l, rnd)
            else:
                assert rnd < warmup or geometry(n)[1] is None
            total += world * got.astype(np.float64)
        kept = 0.0
        for r in range(world):
            mine = res[r][3].residual(l)
            np.testing.assert_allclose(mine, want["residuals"][(r, l)], rtol=0,
                                       atol=1e-5 * max(1.0, float(np.abs(mine).max(initial=0))))
            kept = kept + mine.astype(np.float64)
        # nothing lost, nothing doubled: what was applied plus what is kept is what came in
        folded = want["folded"][l]
        np.testing.assert_allclose(total + kept, folded, rtol=0,
                                   atol=1e-5 * max(1.0, float(np.abs(folded).max(initial=0))))


@pytest.mark.parametrize("comm", ["ps", "ring"])
def test_bytes_are_the_chosen_fraction_plus_one_norm_per_chunk(comm):
    """Rank 0's counters: a PS worker pushes each value it sends once (exact), a ring node
    2(P-1)/P of each vector (within a value per segment); warm-up rounds send everything."""
    world, rounds, warmup = 3, 3, 1
    res = sparse_run(world, comm, rounds, warmup, 0.0)
    rows = {(row["layer"], row["scheme"]): row["all_sent_per_iter"] for row in res[0][1]["layers"]}
    share = 1.0 if comm == "ps" else 2 * (world - 1) / world
    slack = 0 if comm == "ps" else 4 * world
    for l in SHAPES:
        n = count(l)
        chunks, k = geometry(n)
        if k is None:
            values, index = rounds * n, 0
        else:
            values, index = warmup * n + (rounds - warmup) * k * C, (rounds - warmup) * chunks
        assert abs(rows.get((l, comm), 0.0) - share * 4 * values / rounds) <= slack, (l, rows)
        assert abs(rows.get((l, f"{comm}/index"), 0.0) - share * 4 * index / rounds) <= slack
    assert res[0][3].report()["sparse_dense_rounds"] == warmup * 3 + rounds * 3


def test_codec_settings_are_checked_and_travel_in_the_plan():
    infos = [LayerInfo(1, "conv", [(20, 1, 5, 5), (20,)]), LayerInfo(2, "fc", [(500, 800)])]
    plan = make_plan(infos, 4, PlanOptions(comm="ring", codec="sparse", sparse=(0.1, 50, 0.9)))
    msg = plan.to_pb()
    codec = make_codec(msg.codec, msg)
    assert isinstance(codec, SparseCodec)
    assert (codec.ratio, codec.warmup, codec.momentum) == (pytest.approx(0.1), 50, pytest.approx(0.9))
    text = plan_table(plan, 4)
    assert "wire sparse: the 10% of 256-value chunks" in text and "SFB layers stay dense" in text
    assert "50 dense warm-up rounds, momentum correction 0.9" in text
    # 520 values: 3 chunks, one sent: 256 + 3 values instead of 520; 400,000: 1,563 chunks
    assert codec.vectors(520) == {0: 256, 1: 3, 2: 520}
    assert codec.vectors(400_000) == {0: 157 * 256, 1: 1563, 2: 400_000}
    assert codec.vectors(258) == {2: 258}  # 256 values and 2 norms are not fewer than 258
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="--sparse must be a fraction"):
            SparseCodec(bad)


# ------------------------------------------------------------------ the solver's side
class VelocitySync(InlineSync):
    """One worker whose sync keeps SGD's momentum per parameter (u = m·u + g), as the sparse
    codec does with momentum correction in a dense round."""

    def __init__(self, solver: Solver, momentum: float) -> None:
        super().__init__(solver, threaded=False)
        self.momentum = np.float32(momentum)
        self.velocity: dict[int, np.ndarray] = {}

    def release(self, layer: int) -> None:
        net = self.solver.net
        for i, blob in enumerate(net.learnable_params):
            if net.param_layer_index[i] == layer:
                u = self.velocity.setdefault(i, np.zeros_like(blob.diff))
                u *= self.momentum
                u += blob.diff
                blob.diff[...] = u
        super().release(layer)


@pytest.mark.parametrize("iter_size", [1, 2])
def test_a_sync_that_keeps_the_momentum_trains_as_sgd_with_momentum(tiny, iter_size):
    """With the layers handed over, the solver regularizes before release (the weight decay
    rides in the velocity, as in Caffe's history) and applies rate x velocity: SGD with
    momentum, per-param lr and decay multipliers included, to float32 rounding. Without the
    hand-over the momentum would be applied twice, which the same comparison sees."""
    path = write_solver(tiny, lr_policy="fixed", snapshot=0, snapshot_after_train=False,
                        iter_size=iter_size)
    plain = params(train(path))
    for hand_over, close in ((True, True), (False, False)):
        s = Solver(path)
        layers = sorted(set(s.net.param_layer_index))
        s.attach_sync(VelocitySync(s, s.sync_momentum()), layers if hand_over else ())
        s.solve()
        s.close()
        worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(params(s), plain))
        assert (worst < 1e-5) == close, (hand_over, worst)


@pytest.mark.parametrize("extra,needle", [({"type": "Adam", "momentum2": 0.999}, "this solver is Adam"),
                                          ({"clip_gradients": 1.0}, "cannot clip gradients")])
def test_only_sgd_without_clipping_hands_its_momentum_over(tiny, extra, needle):
    s = Solver(write_solver(tiny, **extra))
    with pytest.raises(SolverError, match=needle):
        s.attach_sync(InlineSync(s, False), [1])
    s.close()


# ------------------------------------------------------------------ the command line
def test_job_config_carries_sparse_settings_and_refuses_bad_ones():
    config = JobConfig("s", "h", sparse=0.1, sparse_warmup=100, momentum_correction=False)
    back = JobConfig.from_json(config.to_json())
    assert back == config and back.codec == "sparse" and JobConfig("s", "h").codec == "fp32"
    for kwargs, needle in (({"sparse": 0.1, "wire": "fp16"}, "without --wire fp16"),
                           ({"sparse": 1.0}, "fraction between 0 and 1"),
                           ({"sparse_warmup": 5}, "only with --sparse"),
                           ({"wire": "sparse"}, "--wire must be one of fp32, fp16")):
        with pytest.raises(Exception, match=needle):
            JobConfig("s", "h", **kwargs)


@pytest.mark.parametrize("args,needle", [
    (["--sparse", "0.1", "-n", "2", "--wire", "fp16"], "give it without --wire fp16"),
    (["--sparse-warmup", "10", "-n", "2"], "give --sparse RATIO"),
    (["--no-momentum-correction", "-n", "2"], "give --sparse RATIO"),
    (["--sparse", "0.1"], "give --hosts or -n"),
    (["--sparse", "1.5", "-n", "2"], "0<x<1"),
])
def test_bad_sparse_flags_are_one_line_errors(tmp_path, args, needle):
    solver = tmp_path / "s.prototxt"
    solver.write_text('net: "n.prototxt"\n')
    done = CliRunner().invoke(cli, ["train", "--solver", str(solver), *args])
    assert done.exit_code != 0 and needle in done.output, done.output


@pytest.fixture(scope="module")
def digits_reference(digits_db, tmp_path_factory) -> dict[str, np.ndarray]:
    d = tmp_path_factory.mktemp("sparse_ref")
    done = poseidon("train", "--solver", str(write_run(d, digits_db, TOTAL_BATCH, "ref")),
                    timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return weights(d / f"ref_iter_{ITERS}.caffemodel")


def train_two(tmp_path, db, *flags: str) -> tuple[dict[str, np.ndarray], dict, str]:
    solver = write_run(tmp_path, db, TOTAL_BATCH // 2, "dist")
    hosts, _ = write_hosts(tmp_path, 2)
    stats = tmp_path / "stats.json"
    done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--stats",
                    str(stats), "--timeout", "30", *flags, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return (weights(tmp_path / f"dist_iter_{ITERS}.caffemodel"), json.loads(stats.read_text()),
            done.stderr)


def test_dense_rounds_with_momentum_correction_equal_one_worker(digits_db, digits_reference,
                                                                tmp_path):
    """Every round a warm-up round: the codec's velocity and the solver's rate x velocity are
    SGD with momentum and weight decay; 2 workers equal one with twice the batch."""
    got, s, log = train_two(tmp_path, digits_db, "--comm", "ps", "--sparse", "0.1",
                            "--sparse-warmup", str(ITERS))
    assert s["sparse_momentum"] == pytest.approx(0.9) and s["sparse_rounds"] == 0
    for name, want in digits_reference.items():
        rel = np.linalg.norm(got[name] - want) / np.linalg.norm(want)
        assert rel <= BOUND, (name, rel)
    assert "wire sparse: the 10% of 256-value chunks" in log


def test_sparse_training_sends_a_tenth_and_keeps_replicas_identical(digits_db, tmp_path):
    # one unit per layer (no fusion): the counts below are each layer's
    got, s, _ = train_two(tmp_path, digits_db, "--comm", "ring", "--sparse", "0.1",
                          "--fusion-mb", "0")
    assert s["replicas_identical"] is True and s["sparse_dense_rounds"] == ITERS  # conv1: 80 values
    sent = {(row["name"], row["scheme"]): row["all_sent_per_iter"] for row in s["layers"]}
    # ring, P = 2: a node sends each vector's value once, to within one value per segment
    for name, n in (("ip1", 512 * 256 + 256), ("ip2", 256 * 10 + 10)):
        chunks, k = geometry(n)
        assert abs(sent[(name, "ring")] - 4 * k * C) <= 8, (name, sent)
        assert abs(sent[(name, "ring/index")] - 4 * chunks) <= 8, (name, sent)
    assert abs(sent[("conv1", "ring")] - 4 * (8 * 9 + 8)) <= 8
    assert all(np.isfinite(w).all() for w in got.values())


def test_momentum_correction_needs_sgd(digits_db, tmp_path):
    solver = write_run(tmp_path, digits_db, TOTAL_BATCH // 2, "adam")
    solver.write_text(solver.read_text().replace('type: "SGD"', 'type: "Adam"'))
    done = poseidon("train", "--solver", str(solver), "-n", "2", "--sparse", "0.1", timeout=120)
    assert done.returncode != 0
    assert "this solver is Adam; give --no-momentum-correction" in done.stderr, done.stderr[-2000:]
