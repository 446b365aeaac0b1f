"""The training progress bar on a terminal: a Solver callback (``Solver.add_callback``).

Iteration n of max_iter, the smoothed loss, the learning rate and images/s, with the time
left. While it is live, log lines go through its console (glog.set_printer) so the bar stays
intact. Nothing is drawn unless stderr is a terminal.
"""
from __future__ import annotations

import sys
import time
from typing import Any

from engine import glog


class ProgressBar:
    def __init__(self) -> None:
        self._progress: Any = None

    def on_start(self, solver: Any) -> None:
        if not sys.stderr.isatty():
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
            TimeRemainingColumn

        console = Console(stderr=True)
        self._progress = Progress(TextColumn("iteration"), MofNCompleteColumn(), BarColumn(),
                                  TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  "
                                             "{task.fields[ips]} img/s"),
                                  TimeRemainingColumn(), console=console)
        self._task = self._progress.add_task("train", total=solver.param.max_iter,
                                             completed=solver.iter, loss="-", lr="-", ips="-")
        self._t0 = (time.perf_counter(), solver.iter)
        glog.set_printer(lambda line: console.print(line, markup=False, highlight=False,
                                                    soft_wrap=True))
        self._progress.start()

    def on_iteration(self, solver: Any, loss: float) -> None:
        if self._progress is None:
            return
        t0, it0 = self._t0
        elapsed = time.perf_counter() - t0
        ips = (solver.iter - it0) * solver.images_per_iter() / elapsed if elapsed > 0 else 0.0
        self._progress.update(self._task, completed=solver.iter,
                              loss=f"{solver.smoothed_loss:.4g}", lr=f"{solver.rate:.3g}",
                              ips=f"{ips:.0f}")

    def on_end(self, solver: Any) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            glog.set_printer(None)


class CountProgress:
    """Progress through a known number of items (``poseidon data images``, ``data mean``): a
    rich bar on a terminal with the rate and the time left, else Caffe's ``Processed N
    files.`` line every ``every`` items, with the same two. The rate counts from the first
    ``update`` (a resumed run starts part way). ``say`` prints a line (to stderr) without
    breaking the bar."""

    def __init__(self, what: str, every: int = 1000, unit: str = "images") -> None:
        self._what, self._every, self._unit = what, every, unit
        self._progress: Any = None
        self._console: Any = None
        self._task: Any = None
        self._start: tuple[float, int] | None = None

    def __enter__(self) -> "CountProgress":
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._console = Console(stderr=True)
            # the time left from the rate shown (rich's own estimate follows the last
            # updates, which come a chunk of images at a time)
            self._progress = Progress(TextColumn(self._what), MofNCompleteColumn(), BarColumn(),
                                      TextColumn("{task.fields[rate]} " + self._unit + "/s, "
                                                 "{task.fields[left]} left"),
                                      console=self._console)
            self._progress.start()
        return self

    def rate(self, done: int) -> float:
        """Items a second since the first update."""
        start, first = self._start or (time.perf_counter(), done)
        elapsed = time.perf_counter() - start
        return (done - first) / elapsed if elapsed > 0 else 0.0

    def update(self, done: int, total: int) -> None:
        if self._start is None:
            self._start = (time.perf_counter(), done)
        rate = self.rate(done)
        left = _clock((total - done) / rate) if rate > 0 else "-"
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(self._what, total=total, completed=done,
                                                     rate="-", left="-")
            self._progress.update(self._task, completed=done, rate=f"{rate:.0f}", left=left)
        elif done % self._every == 0 and 0 < done < total:
            self.say(f"Processed {done} files ({rate:.0f} {self._unit}/s, {left} left).")

    def say(self, line: str) -> None:
        if self._console is not None:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


def _clock(seconds: float) -> str:
    """h:mm:ss"""
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
