"""Replayed compute (`poseidon train --replay T --time-scale S`): layers wait their traced time,
everything else is real, so the same gradients of the same sizes cross the wire."""
from __future__ import annotations

import datetime as dt
import json
import re
import time

import numpy as np
import pytest

from engine.perf.trace import LayerTime, Trace
from tests.test_comm_train import (digits_db, poseidon, write_hosts,  # noqa: F401
                                   write_run)

pytestmark = pytest.mark.numpy_kernels

#: the digits net of tests/test_comm_train.py, layer by layer
LAYERS = ["data", "conv1", "relu0", "ip1", "relu1", "ip2", "loss"]
GLOG_TIME = re.compile(r"^I(\d{4}) (\d{2}:\d{2}:\d{2}\.\d{6}) .*\] Iteration (\d+) \(")


def trace(tmp_path, fwd_ms: float, bwd_ms: float):
    path = tmp_path / "trace.json"
    Trace("CommNet", 8, [LayerTime(n, "", fwd_ms, bwd_ms) for n in LAYERS]).save(path)
    return path


def iteration_times(stderr: str) -> dict[int, float]:
    """Iteration number -> its log line's time (seconds), from glog's prefix."""
    out = {}
    for line in stderr.splitlines():
        m = GLOG_TIME.match(line)
        if m:
            t = dt.datetime.strptime(m.group(2), "%H:%M:%S.%f")
            out[int(m.group(3))] = t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
    return out


def test_one_process_takes_the_traced_time(digits_db, tmp_path):  # noqa: F811
    # 7 layers x 2 ms forward and 6 layers x 4 ms backward (the data layer has none), x 3:
    # 114 ms per iteration, plus the replayed solver update (microseconds for these weights)
    solver = write_run(tmp_path, digits_db, 8, "r", iters=12, display=1)
    done = poseidon("train", "--solver", str(solver), "--replay", str(trace(tmp_path, 2, 4)),
                    "--time-scale", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    times = iteration_times(done.stderr)
    period = (times[11] - times[3]) / 8
    # the waits are at least the traced time x 3; above it a busy machine adds what it likes
    # (stress-ng made it 0.21 s), so the upper bound is a liveness bound, not a speed claim.
    # Below it, what the log's stamps allow: the emulated stream keeps its schedule through a
    # late wake-up of under QUEUED_S, which delays the first line's stamp but not the last's
    # (/ 8 iterations), and the stamps are the wall clock, which NTP may slew by 500 ppm
    # against the stream's perf_counter (CI once read 0.11399)
    from engine.perf.replay import QUEUED_S
    assert 0.114 * (1 - 5e-4) - QUEUED_S / 8 <= period <= 1.0, period
    assert "no data is read and no test net is run" in done.stderr


def test_device_work_waits_its_modelled_time_and_computes_nothing(digits_db, tmp_path):  # noqa: F811
    # a GPU worker's update and SFB rebuild are device work: a replayed run waits the model's
    # time for them (here a device slowed down so the waits are long) and computes nothing
    from engine.comm.cost import Device
    from engine.perf.replay import ReplayFactorLayer, make_solver

    solver = write_run(tmp_path, digits_db, 8, "r", iters=2)
    nbytes = sum(p.data.nbytes for p in make_solver(solver, trace(tmp_path, 0, 0), 1.0)
                 .net.learnable_params)
    device = Device(update_bytes_per_s=5 * nbytes / 0.2, gemm_flops_per_s=1e9)
    s = make_solver(solver, trace(tmp_path, 0, 0), 2.0, device=device)
    before = [p.data.copy() for p in s.net.learnable_params]
    t = time.perf_counter()
    s.step(1)
    # the layers take no time: the update is 0.2 s x 2 on the device
    assert 0.4 <= time.perf_counter() - t <= 5.0
    for p, b in zip(s.net.learnable_params, before):
        assert np.array_equal(p.data, b)
    [ip1] = [layer for name, layer in zip(s.net.layer_names, s.net.layers) if name == "ip1"]
    assert isinstance(ip1, ReplayFactorLayer)
    spec = ip1.factor_spec()
    diffs = [b.diff.copy() for b in ip1.blobs]
    rows = 2 * spec.k
    u = np.ones((rows, spec.n), np.float32)
    v = np.ones((rows, spec.m), np.float32)
    t = time.perf_counter()
    ip1.rebuild_gradient(u, v)
    # 2 * rows * m * n flops at 1 GFLOP/s, x 2
    assert 4e-9 * rows * spec.m * spec.n <= time.perf_counter() - t <= 5.0
    for b, d in zip(ip1.blobs, diffs):
        assert np.array_equal(b.diff, d)


def test_replayed_workers_send_the_real_bytes(digits_db, tmp_path):  # noqa: F811
    # --comm hybrid chooses by bytes alone: auto plans from the link and device each run
    # probes, which on a busy machine differ from run to run (ip1 and ip2 once SFB, once hd)
    hosts, _ = write_hosts(tmp_path, 2)
    per_layer = {}
    for name, extra in (("real", []), ("replay", ["--replay", str(trace(tmp_path, 0.5, 1))])):
        solver = write_run(tmp_path / name, digits_db, 8, name, iters=4)
        stats = tmp_path / f"{name}.json"
        done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--stats",
                        str(stats), "--timeout", "20", "--comm", "hybrid", *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        s = json.loads(stats.read_text())
        assert s["replicas_identical"] is True
        per_layer[name] = {r["name"]: (r["scheme"], r["all_sent_per_iter"], r["all_recv_per_iter"])
                           for r in s["layers"]}
    assert per_layer["replay"] == per_layer["real"]
    assert set(per_layer["real"]) == {"conv1", "ip1", "ip2"}


def test_a_trace_without_a_layer_of_the_net_is_named(digits_db, tmp_path):  # noqa: F811
    path = tmp_path / "short.json"
    Trace("other", 8, [LayerTime("conv1", "", 1, 1)]).save(path)
    solver = write_run(tmp_path, digits_db, 8, "r", iters=2)
    done = poseidon("train", "--solver", str(solver), "--replay", str(path))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "poseidon: error: trace other has no times for layer(s) data, relu0, ip1")
