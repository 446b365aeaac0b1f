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
    """Progress through a known number of items (``poseidon data images``): a rich bar on a
    terminal, else Caffe's ``Processed N files.`` line every ``every`` items. ``say`` prints
    a line (to stderr) without breaking the bar."""

    def __init__(self, what: str, every: int = 1000) -> None:
        self._what, self._every = what, every
        self._progress: Any = None
        self._console: Any = None
        self._task: Any = None

    def __enter__(self) -> "CountProgress":
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
                TimeRemainingColumn

            self._console = Console(stderr=True)
            self._progress = Progress(TextColumn(self._what), MofNCompleteColumn(), BarColumn(),
                                      TimeRemainingColumn(), console=self._console)
            self._progress.start()
        return self

    def update(self, done: int, total: int) -> None:
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(self._what, total=total)
            self._progress.update(self._task, completed=done)
        elif done % self._every == 0 and done < total:
            self.say(f"Processed {done} files.")

    def say(self, line: str) -> None:
        if self._console is not None:
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
