"""`poseidon bench cluster`: real `poseidon train` processes on an emulated cluster.

For each worker count P and scheme, P network namespaces with shaped links
(engine/perf/netns.py) each run one real worker (and its PS shard); rank 0's log gives the
steady-state iteration time, /proc/stat the machine's CPU use over the same window, each
host's veth the bytes that crossed its link in that window, rank 0's ``--stats`` the bytes per
node as the transport counts them and the overlap. Next to each measurement stands the DAG model's
prediction for the same configuration (engine/perf/dag.py).

With replayed compute (``--compute replay``) a GPU worker's device work waits (every layer its
traced time x S, the solver update and SFB's rebuild the default GPU's time x S: engine/perf/
replay.py) and each link runs at bandwidth / S: the ratio of compute to communication of the
traced GPUs on the traced network, slowed down S times so that this machine's few cores are not
the bottleneck. Times are reported divided by S. The model prices the update and the rebuild
on the same GPU, and what stays real and is not scaled (the sums of the shards and of the
collectives, on this CPU and shared by 2P processes) at this machine's measured speed, and
so the links' latency and the payload rate one TCP stream gets through the shaper (not the
nominal rate: headers take ~5%, ~1% in the jumbo frames of a fast link). With real compute
(``--compute real``) the update and the rebuild run on this CPU too, and the model prices
them so. A run whose CPU was saturated is not a cluster measurement and is marked so.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engine.comm.auth import KEY_ENV, key_hex, new_key
from engine.comm.link import UNFAIR_MEASURED, Link
from engine.perf.dag import Device, predict
from engine.perf.netinfo import net_info
from engine.perf.netns import EmulatedCluster
from engine.perf.replay import DEVICE as REPLAYED
from engine.perf.trace import Trace, load_trace

PORT = 29500
#: a measurement whose machine was busier than this is not a cluster measurement
CPU_SATURATED = 0.85
_ITER_LINE = re.compile(r"^I(\d{2})(\d{2}) (\d{2}:\d{2}:\d{2}\.\d{6}) .*\] Iteration (\d+) \(")


class BenchError(RuntimeError):
    """A benchmark run that failed; the message names the run and the cause."""


@dataclass
class Measurement:
    workers: int
    scheme: str
    compute: str
    iteration_s: float          # steady state, divided by the time scale
    predicted_s: float
    images_per_s: float
    bytes_per_node: float       # network bytes rank 0's worker sent + received per iteration
    hidden_fraction: float
    cpu_utilisation: float
    cpu_bound: bool
    speedup: float = 1.0
    predicted_speedup: float = 1.0
    efficiency: float = 1.0
    #: bytes crossing each emulated host's link per iteration (its veth's counters, both
    #: directions, headers included), the mean over hosts
    wire_bytes_per_host: float | None = None
    #: rank 0's CPU seconds per iteration by kind of thread, and its shard's (--stats'
    #: cpu_s_per_iter; real seconds: the time scale stretches waits, not CPU)
    cpu_s_per_iter: dict[str, Any] | None = None

    @property
    def error(self) -> float:
        return self.predicted_s / self.iteration_s - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error}


def cpu_device(processes: int) -> Device:
    """This machine's speed at the work that replay leaves real, shared by ``processes``
    busy processes on its cores (they update at the same moments in a synchronous run)."""
    n = 1 << 22
    w, g, h = (np.ones(n, np.float32) for _ in range(3))
    t = _best(lambda: (np.multiply(h, 0.9, out=h), np.add(h, g, out=h), np.subtract(w, h, out=w)))
    update = 5 * 4 * n / t
    u, v = np.ones((256, 1024), np.float32), np.ones((256, 4096), np.float32)
    gemm = 2 * 256 * 1024 * 4096 / _best(lambda: u.T @ v)
    add = 4 * n / _best(lambda: np.add(w, g, out=w))
    share = min(1.0, (os.cpu_count() or 1) / max(processes, 1))
    return Device(f"this CPU shared by {processes} processes (x{share:.2f})",
                  update_bytes_per_s=update * share, gemm_flops_per_s=gemm * share,
                  add_bytes_per_s=add * share, update_on_device=False)


def replayed_device(cpu: Device, time_scale: float) -> Device:
    """The model's device for a replayed run, in its real (stretched) time: the update and
    the rebuild the replayed GPU's (x ``time_scale``), the sums ``cpu``'s."""
    return replace(REPLAYED, name=f"{REPLAYED.name}, replayed x {time_scale:g}; sums on "
                   f"{cpu.name}", update_bytes_per_s=REPLAYED.update_bytes_per_s / time_scale,
                   gemm_flops_per_s=REPLAYED.gemm_flops_per_s / time_scale,
                   add_bytes_per_s=cpu.add_bytes_per_s)


def _best(fn: Any, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


class Sampler:
    """Samples counters every ``period`` s in a thread: (wall time, counters)."""

    def __init__(self, read: Callable[[], list[int]], period: float = 0.1) -> None:
        self.samples: list[tuple[float, list[int]]] = []
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)

    def __enter__(self) -> "Sampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sample()

    def _sample(self) -> None:
        try:
            self.samples.append((time.time(), self._read()))
        except OSError:  # a link already deleted at the end: the samples so far stand
            pass

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self._sample()

    def at(self, t: float) -> list[float] | None:
        """The counters at time ``t``, interpolated between the samples around it (clamped
        to the first and last sample)."""
        if not self.samples:
            return None
        later = next((i for i, (ts, _) in enumerate(self.samples) if ts >= t), None)
        if later is None:
            return [float(c) for c in self.samples[-1][1]]
        if later == 0:
            return [float(c) for c in self.samples[0][1]]
        (t0, c0), (t1, c1) = self.samples[later - 1], self.samples[later]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return [a + w * (b - a) for a, b in zip(c0, c1)]

    def delta(self, start: float, end: float) -> list[float] | None:
        """Counter growth over [start, end]; a window shorter than the period still gets
        the rate of the samples around it."""
        a, b = self.at(start), self.at(end)
        return None if a is None or b is None else [y - x for x, y in zip(a, b)]


def cpu_sampler(period: float = 0.1) -> Sampler:
    """/proc/stat's busy and total jiffies of all CPUs."""
    def read() -> list[int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + (f[4] if len(f) > 4 else 0)
        return [sum(f) - idle, sum(f)]
    return Sampler(read, period)


def utilisation(cpu: Sampler, start: float, end: float) -> float:
    """Busy share of all CPUs over [start, end]."""
    d = cpu.delta(start, end)
    # interpolated counters can put busy a rounding error above total: a share is at most 1
    return min(1.0, max(0.0, d[0] / d[1])) if d and d[1] > 0 else float("nan")


def link_sampler(cluster: EmulatedCluster, period: float = 0.1) -> Sampler:
    """Bytes each emulated host's link carried, both directions, as its veth counts them."""
    return Sampler(lambda: [sum(cluster.link_bytes(h)) for h in range(cluster.n)], period)


def iteration_times(log: str) -> dict[int, float]:
    """Iteration -> wall time (epoch seconds) of rank 0's 'Iteration N (' lines, dated by
    their glog month and day (a run may cross midnight; the year is this one's, or the last
    one's for a December line read in January)."""
    today = dt.date.today()
    out = {}
    for line in log.splitlines():
        m = _ITER_LINE.match(line)
        if m:
            month, day = int(m.group(1)), int(m.group(2))
            year = today.year - (month > today.month)
            t = dt.datetime.combine(dt.date(year, month, day), dt.time.fromisoformat(m.group(3)))
            out[int(m.group(4))] = t.timestamp()
    return out


def split_variant(spec: str) -> tuple[str, list[str]]:
    """'ps:--no-priority --fusion-mb=4' -> ('ps', ['--no-priority', '--fusion-mb=4']): a
    scheme and the train options of one variant of it."""
    comm, _, extra = spec.partition(":")
    return comm, shlex.split(extra)


def bench_solver(solver: Path, out: Path, iters: int) -> Path:
    """A copy of ``solver`` for one measurement: ``iters`` iterations logged one by one, no
    tests and no snapshots, its net named by an absolute path."""
    from engine.caffe_io import read_solver_prototxt, write_prototxt

    param = read_solver_prototxt(solver)
    for f in ("net", "train_net"):
        if param.HasField(f) and not Path(getattr(param, f)).is_absolute():
            local = solver.parent / getattr(param, f)
            setattr(param, f, str(local.resolve() if local.exists() else Path(getattr(param, f)).resolve()))
    param.max_iter = iters
    param.display = 1
    param.snapshot = 0
    param.snapshot_after_train = False
    param.test_interval = 0
    param.ClearField("test_iter")
    param.snapshot_prefix = str(out / "snap")
    path = out / "solver.prototxt"
    write_prototxt(path, param)
    return path


def measure(solver: Path, workers: int, scheme: str, bits_per_s: float, compute: str,
            trace_path: Path | None, time_scale: float, iters: int, warmup: int,
            timeout: float = 600.0, slots: int = 1
            ) -> tuple[float, dict[str, Any], float, Link, float | None]:
    """One run: (period in scaled seconds, rank 0's stats, CPU utilisation, the link as
    measured: its latency and the goodput of one TCP stream, the bytes per iteration that
    crossed an emulated host's link: headers and heartbeats included, the mean over hosts).
    ``slots`` workers share each emulated host (its namespace, its one shaped link)."""
    slots = slots if workers > 1 else 1
    scale = time_scale if compute == "replay" else 1.0
    # the ranks are started by hand, each in its namespace: hand them this run's key as a
    # launcher would
    env = {**os.environ, KEY_ENV: key_hex(new_key())}
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-") as d:
        out = Path(d)
        copy = bench_solver(solver, out, warmup + iters)
        with EmulatedCluster(workers // slots, bits_per_s / scale) as cluster, \
                cpu_sampler() as cpu, link_sampler(cluster) as wire:
            link = Link(cluster.measure_latency(50), 8.0 / cluster.measure_goodput(),
                        "emulated link, measured", UNFAIR_MEASURED)
            hosts = out / "hosts.txt"
            hosts.write_text("".join(f"{a}:{PORT} slots={slots}\n" for a in cluster.addresses))
            procs = []
            for r in range(workers):
                cmd = [sys.executable, "-m", "poseidon_cli.main", "train", "--solver", str(copy)]
                if workers > 1:
                    comm, extra = split_variant(scheme)
                    cmd += ["--hosts", str(hosts), "--rank", str(r), "--comm", comm,
                            "--timeout", "60", *extra]
                    if r == 0:
                        cmd += ["--stats", str(out / "stats.json")]
                if compute == "replay":
                    cmd += ["--replay", str(trace_path), "--time-scale", f"{time_scale:g}"]
                log = open(out / f"rank{r}.log", "w")
                procs.append((cluster.run(r // slots, cmd, stdout=subprocess.DEVNULL, stderr=log,
                                          cwd=os.getcwd(), env=env), log))
            deadline = time.monotonic() + timeout
            for r, (p, log) in enumerate(procs):
                try:
                    p.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise BenchError(f"P={workers} {scheme}: rank {r} still running after "
                                     f"{timeout:g} s") from None
                finally:
                    log.close()
                if p.returncode != 0:
                    tail = (out / f"rank{r}.log").read_text().strip().splitlines()[-3:]
                    raise BenchError(f"P={workers} {scheme}: rank {r} exited with code "
                                     f"{p.returncode}: {' | '.join(tail)}")
        times = iteration_times((out / "rank0.log").read_text())
        first, last = warmup - 1, warmup + iters - 1
        if first not in times or last not in times:
            raise BenchError(f"P={workers} {scheme}: rank 0 logged no iterations {first}..{last}")
        period = (times[last] - times[first]) / iters
        stats = json.loads((out / "stats.json").read_text()) if workers > 1 else {}
        crossed = wire.delta(times[first], times[last])
        per_host = sum(crossed) / len(crossed) / iters if crossed else None
        return period, stats, utilisation(cpu, times[first], times[last]), link, per_host


def run_bench(solver: Path, workers: list[int], schemes: list[str], bits_per_s: float,
              compute: str, trace_path: Path | None, time_scale: float, iters: int,
              warmup: int, say: Any = print, slots: int = 1) -> list[Measurement]:
    """Every (P, scheme); P = 1 is one plain process, once. Speedups are against it. With
    ``slots``, P workers run ``slots`` to an emulated host."""
    info = net_info(solver)
    if compute == "replay":
        trace = load_trace(trace_path)  # type: ignore[arg-type]
    else:
        trace = _measured_trace(solver)
    scale = time_scale if compute == "replay" else 1.0
    rows: list[Measurement] = []
    base: Measurement | None = None
    for p in sorted(set(workers) | {1}):
        for scheme in (["-"] if p == 1 else schemes):
            period, stats, cpu, link, per_host = measure(
                solver, p, scheme if p > 1 else "ps", bits_per_s, compute, trace_path,
                time_scale, iters, warmup, slots=slots)
            device = cpu_device(2 * p if p > 1 else 1)
            if compute == "replay":
                device = replayed_device(device, scale)
            comm, extra = split_variant(scheme) if p > 1 else ("ps", [])
            pred = predict(info, trace.scaled(scale) if scale != 1 else trace, p, comm, link,
                           device, slots=slots if p > slots else 1,
                           levels="--no-levels" not in extra)
            net_bytes = sum(r["net_sent_per_iter"] + r["net_recv_per_iter"]
                            for r in stats.get("layers", []))
            m = Measurement(p, scheme, compute, period / scale, pred.iteration_s / scale,
                            p * info.batch / (period / scale), net_bytes,
                            float(stats.get("hidden_fraction", 0.0)), cpu,
                            bool(cpu > CPU_SATURATED), wire_bytes_per_host=per_host,
                            cpu_s_per_iter=stats.get("cpu_s_per_iter"))
            if p == 1:
                base = m
            assert base is not None
            m.speedup = m.images_per_s / base.images_per_s
            m.predicted_speedup = base.predicted_s * p / m.predicted_s
            m.efficiency = m.speedup / p
            rows.append(m)
            say(m)
    return rows


def _measured_trace(solver: Path) -> Trace:
    """`--compute real`: this machine's own layer times for the training net, measured now."""
    from engine.perf.timing import time_net
    from engine.perf.trace import trace_from_dict
    from engine.solver import Solver

    s = Solver(solver)
    try:
        report = time_net(s.net, 5)
    finally:
        s.close()
    return trace_from_dict(report.as_dict(), "poseidon time (measured now, this CPU)")


def summary(rows: list[Measurement]) -> dict[str, Any]:
    counted = [r for r in rows if not r.cpu_bound and r.workers > 1]
    errors = [abs(r.error) for r in counted]
    return {"rows": [r.as_dict() for r in rows],
            "counted": len(counted),
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None}
