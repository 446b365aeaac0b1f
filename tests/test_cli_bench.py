"""`poseidon bench`: the group, `bench comm` (transport against raw TCP, the alpha-beta fit)
and `bench cluster` (real workers in namespaces, real compute on a small net)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

from engine import backend
from engine.comm.link import load_link
from tests.test_cli_caffe_habits import run
from tests.test_comm_train import digits_db, write_run  # noqa: F401

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = pytest.mark.slow


def test_bench_lists_its_subcommands():
    done = run("bench", "--help")
    assert done.returncode == 0
    listed = done.stdout.split("Commands:")[1].split()
    assert {"cluster", "comm"} <= set(listed)


def test_bench_comm_measures_both_and_fits_a_link(tmp_path):
    out, link = tmp_path / "comm.json", tmp_path / "link.json"
    done = run("bench", "comm", "--sizes", "4K,256K", "--repeats", "3", "--json", str(out),
               "--link-out", str(link))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [r["bytes"] for r in report["rows"]] == [4096, 262144]
    for r in report["rows"]:
        assert r["poseidon_mb_s"] > 0 and r["tcp_mb_s"] > 0
        assert r["ratio"] == pytest.approx(r["poseidon_mb_s"] / r["tcp_mb_s"])
        assert r["unauthenticated_mb_s"] > 0
        assert r["auth_cost"] == pytest.approx(1 - r["poseidon_mb_s"] / r["unauthenticated_mb_s"])
    from poseidon_cli.benches.comm import gloo_available
    for r in report["rows"]:  # Gloo beside them when PyTorch is installed, else said so
        if gloo_available():
            assert r["gloo_mb_s"] > 0 and r["gloo_one_way_s"] > 0
            assert r["gloo_ratio"] == pytest.approx(r["poseidon_mb_s"] / r["gloo_mb_s"])
        else:
            assert r["gloo_mb_s"] is None and "PyTorch not installed" in done.stdout
    fitted = load_link(link)
    # what the fit says of a measured link depends on how busy the machine was (under load a
    # 4 KB trip can take longer than a 256 KB one); the fit itself is checked exactly below
    assert fitted.beta_s_per_byte > 0 and fitted.alpha_s >= 0
    assert fitted.source.startswith("poseidon bench comm")
    assert [t["workers"] for t in report["schemes"]] == [2, 4, 8, 16]


def test_the_link_fit_recovers_alpha_and_beta():
    from poseidon_cli.benches.comm import fit_link

    alpha, beta = 80e-6, 1 / 2e9
    sizes = [1 << k for k in range(10, 27, 2)]
    noise = [1.03, 0.98, 1.01, 0.97, 1.02, 1.0, 0.99, 1.02, 0.98]  # +-3%, deterministic
    fitted = fit_link([(n, (alpha + beta * n) * e) for n, e in zip(sizes, noise)])
    assert fitted.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fitted.beta_s_per_byte == pytest.approx(beta, rel=0.05)
    for n in sizes:  # the fit passes near its points
        assert fitted.time(n) == pytest.approx(alpha + beta * n, rel=0.05)
    # points that go down with size (a busy machine) give no negative latency or bandwidth
    odd = fit_link([(4096, 2e-3), (262144, 1e-3)])
    assert odd.alpha_s >= 0 and odd.beta_s_per_byte > 0


def test_the_stage_breakdown_adds_up_to_the_round_trip():
    """Each stage starts where the one before it ended, across the two processes' marks, so
    the stages of one ping-pong add up to its round trip."""
    from poseidon_cli.benches.comm_stages import _legs

    client = [(1, "call", 0), (1, "serialised", 10_000), (1, "tagged", 30_000),
              (1, "received", 400_000), (1, "verified", 420_000), (1, "checked", 430_000),
              (1, "handed", 435_000), (1, "woken", 500_000)]
    server = [(1, "received", 150_000), (1, "verified", 180_000), (1, "checked", 200_000),
              (1, "handed", 210_000), (1, "call", 215_000), (1, "serialised", 220_000),
              (1, "tagged", 240_000)]
    out = _legs(client, server, range(1, 2))
    us = [st["us"] for st in out["stages"]]
    assert out["round_trip_us"] == 500.0 and sum(us) == pytest.approx(500.0)
    assert us[:4] == [10.0, 20.0, 120.0, 30.0]  # serialise, tag, ZeroMQ there, verify
    assert us[-1] == 65.0  # the waiting thread wakes


def test_bench_comm_through_a_link_without_root_says_so(monkeypatch):
    from poseidon_cli.main import cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = CliRunner().invoke(cli, ["bench", "comm", "--bandwidth", "1gbit"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        "poseidon: error: bench comm --bandwidth needs root (network namespaces); run it with "
        "sudo")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="the emulated link needs root and iproute2")
def test_bench_comm_through_an_emulated_link(tmp_path):
    """Each end in a namespace of its own, joined by a link shaped to 5 Gbit/s: every peer's
    stream is held to the link's rate (on loopback they run at several GB/s)."""
    out = tmp_path / "link.json"
    done = run("bench", "comm", "--bandwidth", "5gbit", "--sizes", "256K", "--repeats", "1",
               "--no-gloo", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "one emulated link of 5gbit" in done.stdout
    [row] = json.loads(out.read_text())["rows"]
    # tbf lets through 4 ms of traffic at once, and each stream moves 64 MB (about 107 ms at
    # 625 MB/s): the rate cannot pass the link's by more than a few per cent
    for rate in (row["tcp_mb_s"], row["poseidon_mb_s"], row["unauthenticated_mb_s"]):
        assert 0 < rate < 5e9 / 8 / 1e6 * 1.1


def test_bench_cluster_without_root_says_so(monkeypatch):
    from poseidon_cli.main import cli
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = CliRunner().invoke(cli, ["bench", "cluster", "--solver", "s.prototxt", "--compute", "real"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        "poseidon: error: bench cluster needs root (network namespaces); run it with sudo")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("tc") is None,
                    reason="the emulated cluster needs root and iproute2")
def test_bench_cluster_real_compute_on_a_small_net(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 16, "b", iters=1)
    out = tmp_path / "cluster.json"
    done = run("bench", "cluster", "--solver", str(solver), "--workers", "1,2", "--scheme",
               "hybrid", "--compute", "real", "--bandwidth", "1gbit", "--iters", "3",
               "--warmup", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {(r["workers"], r["scheme"]): r for r in report["rows"]}
    assert set(rows) == {(1, "-"), (2, "hybrid")} and report["compute"] == "real"
    two = rows[(2, "hybrid")]
    assert two["iteration_s"] > 0 and two["predicted_s"] > 0 and two["bytes_per_node"] > 0
    assert 0 <= two["cpu_utilisation"] <= 1
    assert "compute: real" in done.stderr
    # where rank 0's CPU went, per iteration, in the report and on the row's next line
    # (the kinds themselves: tests/test_perf_cpu.py; a few iterations of a tiny net are a few
    # milliseconds of CPU, so only the whole is sure to be more than none)
    split = two["cpu_s_per_iter"]
    kinds = ("training", "progress", "transport", "other", "shard")
    assert all(split[k] >= 0 for k in kinds) and sum(split[k] for k in kinds) > 0, split
    assert "rank 0 CPU per iteration: training " in done.stdout


def test_bench_time_without_torch_times_the_engine_alone(monkeypatch, tmp_path):
    from poseidon_cli.benches import time as bench_time
    from poseidon_cli.main import cli
    monkeypatch.setattr(bench_time, "torch_available", lambda: False)
    out = tmp_path / "time.json"
    r = CliRunner().invoke(cli, ["bench", "time", "--nets", "lenet", "--repeats", "1",
                                 "--iterations", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "PyTorch is not installed" in r.output
    report = json.loads(out.read_text())
    assert report["peers"] == ["poseidon"]
    assert report["nets"]["lenet"]["median_ms"]["poseidon"] > 0
    assert report["nets"]["lenet"]["train_median_ms"]["poseidon"] > 0
    assert "train step poseidon" in r.output
    assert "ratio_vs_torch" not in report["nets"]["lenet"]
    # no Caffe binary: its recorded time, said to be recorded
    assert "RECORDED, not this run" in r.output
    assert report["nets"]["lenet"]["recorded_caffe_ms"] == 17.6
    assert "openblas" in report["blas"]["poseidon"].lower()


def test_bench_time_times_a_given_caffe_on_the_same_net(monkeypatch, tmp_path):
    from poseidon_cli.benches import time as bench_time
    from poseidon_cli.main import cli
    monkeypatch.setattr(bench_time, "torch_available", lambda: False)
    # a stand-in for `caffe time`: checks it was handed a readable net, prints Caffe's lines
    fake = tmp_path / "caffe"
    fake.write_text("#!/bin/sh\n"
                    'test "$1" = time && grep -q \'type: "Input"\' "$3" || exit 3\n'
                    'echo "Core: Haswell" >&2\n'
                    'echo "I1125 caffe.cpp:412] Average Forward-Backward: 40 ms." >&2\n')
    fake.chmod(0o755)
    out = tmp_path / "time.json"
    r = CliRunner().invoke(cli, ["bench", "time", "--nets", "lenet", "--repeats", "1",
                                 "--iterations", "1", "--caffe", str(fake), "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    lenet = report["nets"]["lenet"]
    assert report["peers"] == ["poseidon", "caffe"] and lenet["median_ms"]["caffe"] == 40.0
    assert lenet["ratio_vs_caffe"] == pytest.approx(lenet["median_ms"]["poseidon"] / 40.0)
    assert "recorded_caffe_ms" not in lenet and "RECORDED" not in r.output
    assert "Haswell kernel, 1 threads" in report["blas"]["caffe"]


def test_bench_train_starts_a_run_once_the_last_ones_memory_is_freed(monkeypatch):
    """At least SETTLE_S, then until MemFree holds still for a second (two half-second
    samples), at most SETTLE_MAX_S; without /proc/meminfo, SETTLE_S alone."""
    from poseidon_cli.benches import train as bench_train
    clock = [0.0]
    monkeypatch.setattr(bench_train.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(bench_train.time, "monotonic", lambda: clock[0])
    mb = 1 << 20
    freeing = iter([100 * mb, 108 * mb, 116 * mb, 117 * mb, 118 * mb, 118 * mb, 118 * mb])
    monkeypatch.setattr(bench_train, "_mem_free", lambda: next(freeing))
    assert bench_train.settle() == bench_train.SETTLE_S + 2.0  # rising, rising, still, still
    clock[0] = 0.0
    rising = iter(range(0, 10 ** 12, 8 * mb))
    monkeypatch.setattr(bench_train, "_mem_free", lambda: next(rising))
    assert bench_train.settle() == pytest.approx(bench_train.SETTLE_MAX_S, abs=0.5)
    clock[0] = 0.0
    monkeypatch.setattr(bench_train, "_mem_free", lambda: None)
    assert bench_train.settle() == bench_train.SETTLE_S


@pytest.mark.parametrize("n", [1, 2, 4, 5, 10])
def test_bench_train_orders_its_repeats_so_no_run_keeps_its_predecessor(n):
    """Each peer right after every other one equally often (a balanced Latin square): once in
    n repeats, twice in 2n for an odd n; and every repeat runs every peer once."""
    from collections import Counter

    from poseidon_cli.benches.alternation import order
    peers = [f"p{i}" for i in range(n)]
    rows = [order(peers, k) for k in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(r) == peers for r in rows)
    pairs = Counter((r[i - 1], r[i]) for r in rows for i in range(1, n))
    want = 1 if n % 2 == 0 else 2
    assert pairs == Counter({(a, b): want for a in peers for b in peers if a != b})
    assert order([], 3) == []


def test_bench_comm_allreduce_times_a_collective_from_its_last_ranks_start():
    """A collective's time per repeat runs from the start of its last rank to the end of its
    last (a barrier lets ranks go at times of their own), per round of the repeat's batch,
    and the row is the median; a scheme's sums (one span a round) are taken in the repeats'
    batches too; each engine runs beside its own bare call, in processes of its own; the
    warm-up runs 500 rounds or 64 MB a peer."""
    from poseidon_cli.benches.allreduce import (BARE, collective_time, groups,
                                                rounds_per_repeat, warm_up_alternations)
    ranks = [[(0.0, 1.0), (10.0, 10.5), (20.0, 21.0)],   # rank 0 left each barrier first
             [(0.5, 1.2), (10.3, 10.4), (20.0, 22.0)]]
    # 1.2 - 0.5, 10.5 - 10.3, 22 - 20: their median
    assert collective_time(ranks) == pytest.approx(0.7)
    assert collective_time(ranks, rounds=2) == pytest.approx(0.35)
    four = [ranks[0] + [(30.0, 30.1)], ranks[1] + [(30.0, 30.3)]]
    # repeats of two spans: (0.7 + 0.2) / 2 and (2 + 0.3) / 2, their median
    assert collective_time(four, spans=2) == pytest.approx((0.45 + 1.15) / 2)
    assert groups(True, True) == [(["ring", "hd", "gloo", BARE[0]], False), (["mpi", BARE[1]], True)]
    assert groups(False, True) == [(["mpi", BARE[1], "ring", "hd"], True)]
    assert groups(False, False) == []
    assert [rounds_per_repeat(n) for n in (64 << 10, 1 << 20, 64 << 20)] == [64, 32, 1]
    assert warm_up_alternations(64 << 10, 40) == 8      # 500 rounds
    assert warm_up_alternations(1 << 20, 40) == 2       # 64 MB
    assert warm_up_alternations(64 << 20, 8) == 8       # as many as are timed, one round each


@pytest.mark.skipif(importlib.util.find_spec("torch") is None
                    and importlib.util.find_spec("mpi4py") is None,
                    reason="needs PyTorch or MPI (the engines and the barrier)")
def test_bench_comm_allreduce_runs_every_peer_and_times_a_round(tmp_path):
    """End to end, two processes a set: every peer's row, each scheme's sum about its
    round's time or less (a sum is one span a round of a batch of its own, timed apart from
    the rounds, so the bound is loose: a mis-grouped one would read 64 rounds' time), and
    the engine's ratio over its own bare call."""
    from poseidon_cli.benches.allreduce import ENGINE_OF, SCHEMES
    out = tmp_path / "allreduce.json"
    done = run("bench", "comm", "--allreduce", "--workers", "2", "--sizes", "4K",
               "--repeats", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    [row] = report["rows"]
    assert (row["workers"], row["bytes"], row["rounds_per_repeat"], row["repeats"]) == \
        (2, 4096, 64, 5)
    peers = report["notes"]["peers"]
    schemes = [p for p in peers if p in SCHEMES]
    assert set(row["seconds"]) == set(peers) | {f"{s}: sum" for s in schemes}
    assert all(0 < t < 1 for t in row["seconds"].values()), row["seconds"]
    for s in schemes:
        assert row["seconds"][f"{s}: sum"] < 4 * row["seconds"][s]
    engines = [s for s in ENGINE_OF if s in peers]
    assert engines and set(row["engine_over_bare"]) == set(engines)
    for s in engines:
        assert row["engine_over_bare"][s] == pytest.approx(
            row["seconds"][s] / row["seconds"][ENGINE_OF[s]])


def test_bench_train_poseidon_side(monkeypatch, tmp_path):
    from poseidon_cli.benches import time as bench_time
    from poseidon_cli.benches import train as bench_train
    from poseidon_cli.main import cli
    monkeypatch.setattr(bench_time, "torch_available", lambda: False)
    monkeypatch.setattr(bench_train, "settle", lambda: 0.0)  # a quiet start is the benchmark's
    out = tmp_path / "train.json"
    r = CliRunner().invoke(cli, ["bench", "train", "--workers", "1,2", "--scheme", "hybrid,ring",
                                 "--net", "conv", "--repeats", "1", "--iters", "12",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    rows = {(p["workers"], p["comm"]): p for p in report["poseidon"]}
    assert set(rows) == {(1, "-"), (2, "hybrid"), (2, "ring")} and report["ddp"] == []
    assert all(p["net"] == "conv" for p in report["poseidon"])
    assert rows[(2, "ring")]["plan"] == ["ring"] and rows[(2, "hybrid")]["plan"] == ["ps"]
    assert rows[(2, "ring")]["images_per_s"] > 0 and rows[(2, "ring")]["worker_bytes_per_iter"] > 0


@pytest.mark.skipif(backend.cupy_available(), reason="checks the machine without a GPU")
def test_bench_time_on_a_gpu_that_is_not_there_is_one_line():
    from poseidon_cli.main import cli
    r = CliRunner().invoke(cli, ["bench", "time", "--gpu", "0", "--nets", "lenet"])
    assert r.exit_code != 0
    assert "--gpu 0: CuPy with a CUDA GPU is not available on this machine" in r.output


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch (the peer)")
@pytest.mark.parametrize("name", ["googlenet", "resnet50"])
def test_the_torch_peer_runs_the_gpu_nets_layer_types(tmp_path, name):
    """Concat, Split, BatchNorm, Scale, Eltwise, global pooling and weighted losses map to torch
    ops: the peer's loss at batch 2 is the engine's (same weights, same zeros; the heads'
    losses summed with their loss_weight; dropout off, since the two draw other masks)."""
    from engine.net import Net
    from poseidon_cli.benches.time import write_net
    from poseidon_cli.benches.torch_peer import build
    proto = write_net(name, tmp_path, 2)
    proto.write_text(re.sub(r"dropout_ratio: [0-9.]+", "dropout_ratio: 0.0", proto.read_text()))
    net = Net(str(proto), phase="TRAIN")
    step, params = build(net)
    theirs = float(step())
    ours = net.forward_prefilled()
    assert theirs == pytest.approx(ours, rel=1e-4)
    assert all(p.grad is not None for p in params)


def test_bench_train_without_scikit_learn_is_one_line(tmp_path):
    """scikit-learn hidden (a package of that name that fails to import): the digits it trains
    on are not there, which is one error line, not a traceback."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text("raise ImportError('hidden for a test')\n")
    done = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "bench", "train",
                           "--iters", "6", "--workers", "1", "--net", "conv"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "poseidon: error: the digits data set comes with scikit-learn (pip install scikit-learn)"]
