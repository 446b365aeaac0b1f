"""Where a worker's CPU goes: seconds per thread and per process, on Linux's CPU-time clocks.

A worker's threads have names: the thread that trains; the communicator's progress thread
(``poseidon-progress``: sums, SFB's rebuilds of the gradients from their factors, codecs and
the solver's updates, work a GPU worker does on its device); its transport (``poseidon-recv``,
``-send``, ``-heartbeat``, an engine's threads, ZeroMQ's ``ZMQbg/*`` I/O threads: moving,
authenticating and checking bytes); and everything else (BLAS and Numba pools, data prefetch,
threads that ended) is the rest of the process. ``CpuMeter`` takes those apart over a stretch
of iterations, and its shard's CPU beside them, so a run can say what the communicator costs
apart from the compute it serves (``--stats``; ``poseidon bench cluster``). Each thread's and
process's CPU clock is the kernel's exact count (``clock_gettime`` of the clock Linux keeps
for each): /proc's user and system times are whole 10 ms ticks, and a short stretch on a busy
machine could read none at all; /proc's are the fallback. Empty where there is no /proc.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: the communicator's thread that sums and updates
PROGRESS = "poseidon-progress"
#: thread-name prefixes of the transport (Poseidon's other threads, ZeroMQ's I/O threads)
TRANSPORT_PREFIXES = ("poseidon-", "ZMQbg")


def _stat(path: str) -> tuple[str, list[str]] | None:
    """(kernel name, the fields after it) of a /proc stat file; None when it is gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()


def stat_cpu(path: str) -> tuple[str, float] | None:
    """(kernel name, user + system seconds) of a /proc stat file; None when it is gone."""
    got = _stat(path)
    if got is None:
        return None
    name, fields = got
    return name, (int(fields[11]) + int(fields[12])) / _TICK


def cpu_clock(id_: int, thread: bool) -> float | None:
    """CPU seconds on Linux's clock of process ``id_`` (its ended threads included) or of
    thread ``id_`` of this process (glibc's encoding of those clocks' ids, CPUCLOCK_SCHED);
    None when it is gone, or where there is no such clock."""
    try:
        return time.clock_gettime((~id_ << 3) | (6 if thread else 2))
    except (OSError, OverflowError, AttributeError):
        return None


def process_cpu(pid: int | str = "self") -> float | None:
    """CPU seconds of a whole process (its ended threads included)."""
    seconds = cpu_clock(os.getpid() if pid == "self" else int(pid), thread=False)
    if seconds is not None:
        return seconds
    got = stat_cpu(f"/proc/{pid}/stat")
    return None if got is None else got[1]


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (a worker's shard)."""
    out = []
    for entry in os.listdir("/proc"):
        got = _stat(f"/proc/{entry}/stat") if entry.isdigit() else None  # None: gone meanwhile
        if got is not None and int(got[1][1]) == pid:
            out.append(int(entry))
    return out


def threads_cpu(training: int | None = None) -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name: a Python thread by its
    ``threading`` name (``training`` is the native id of the one that trains), another by the
    kernel's; threads of one name summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    if training is not None:
        names[training] = "training"
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in map(int, tids):
        name, seconds = names.get(tid), cpu_clock(tid, thread=True)
        if name is None or seconds is None:  # the kernel's name, or /proc's ticks
            got = stat_cpu(f"/proc/self/task/{tid}/stat")
            if got is None:  # ended meanwhile
                continue
            name, seconds = name or got[0], got[1] if seconds is None else seconds
        out[name] = out.get(name, 0.0) + seconds
    return out


class CpuMeter:
    """This process's CPU over a stretch of iterations, split by kind of thread, with a child
    process's (a worker's shard). Made on the training thread; ``begin`` and ``end`` may be
    called from any thread."""

    def __init__(self, child: int | None = None) -> None:
        self.training = threading.get_native_id()
        self.child = child
        self._start: tuple[float, dict[str, float], float] | None = None

    def begin(self) -> None:
        """The stretch starts (e.g. when the warm-up iterations are over)."""
        proc = process_cpu()
        if proc is None:
            return
        child = process_cpu(self.child) if self.child is not None else None
        self._start = (proc, threads_cpu(self.training), child or 0.0)

    def end(self, iterations: int) -> dict[str, Any]:
        """CPU seconds per iteration since ``begin``: ``training`` (forward, backward, the
        release of gradients), ``progress`` and ``transport`` (the threads named above),
        ``other`` (the rest of the process, threads that ended included: read it while the
        threads that matter live), ``shard`` (the child), and ``threads`` by name. {} without
        a begin."""
        proc = process_cpu()
        if self._start is None or proc is None or iterations < 1:
            return {}
        proc0, threads0, child0 = self._start
        threads = {k: v - threads0.get(k, 0.0) for k, v in threads_cpu(self.training).items()}
        training = threads.get("training", 0.0)
        progress = threads.get(PROGRESS, 0.0)
        transport = sum(v for k, v in threads.items()
                        if k.startswith(TRANSPORT_PREFIXES) and k != PROGRESS)
        out: dict[str, Any] = {"iterations": iterations}
        per = {"training": training, "progress": progress, "transport": transport,
               "other": max(proc - proc0 - training - progress - transport, 0.0)}
        child = process_cpu(self.child) if self.child is not None else None
        if child is not None:
            per["shard"] = child - child0
        out.update({k: v / iterations for k, v in per.items()})
        out["threads"] = {k: v / iterations for k, v in sorted(threads.items()) if v > 0}
        return out
