"""Decoding workers: the threads that decode and transform a data layer's images in parallel.

A data layer cuts each batch into jobs (one image each, or one picture and its windows) that
write into the batch's own rows, so which worker runs a job, and when, changes nothing in
the batch: one decoder or four give the same bits. The prefetch thread (engine.data.prefetch)
reads the records in order and hands the jobs over; up to its queue depth of batches are in
flight at once, so the workers go from one batch to the next without waiting for the slowest
image of each.

Threads, not processes, measured on this project's 2-core VM (256x256 JPEG records, batch
128, crop 227, mirror, mean values): Pillow's JPEG decoder and NumPy's arithmetic run with the
GIL released, and once the pixels are decoded straight into NumPy memory
(engine.data.datum) what holds the GIL is a few tens of microseconds of Python an image
against some 600 of decoding. Two decoding threads then keep both cores busy and run 1.87x
one on JPEG records (`poseidon bench data`, steady state: README, "Feeding the workers").
Processes would add a copy of every batch (or shared memory), their own start-up with NumPy
and Pillow imported, and care on every exit path.

``DecoderPool(0)`` runs every job at once in the calling thread: one decoder, no hand-over.
"""
from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable

#: the most decoders a layer takes by default: past that the prefetch queue, not decoding,
#: bounds a CPU worker, and a GPU worker's extra decoders would take cores from its peers
MAX_DEFAULT_DECODERS = 4


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_decoders() -> int:
    """Decoders when data_param.decoders is 0: this process's usable cores, at most 4.

    Idle decoders cost nothing (they wait on the prefetch queue, which holds a few batches),
    so the count only bounds how many cores decoding may take when the consumer is faster
    than one decoder; several training workers on one machine share those cores as their
    load says, and the thread count does not add work.
    """
    return max(1, min(MAX_DEFAULT_DECODERS, usable_cores()))


class Pending:
    """The jobs of one batch in flight: ``wait`` returns when they have all run."""

    def __init__(self, count: int):
        self._left = count
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.cancelled = False
        if count == 0:
            self._done.set()

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every job has run; raise the first exception a job raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"decoding jobs still running after {timeout} s")
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Jobs not started yet are skipped (the batch is thrown away: a seek or close)."""
        self.cancelled = True


@dataclass
class DecodeStats:
    """Where a data layer's time went, summed over its batches (seconds; decode and transform
    summed over the workers, so on several cores they can exceed the wall-clock time)."""

    batches: int = 0
    records: int = 0
    #: reading records from the source, in the prefetch thread
    read_s: float = 0.0
    decode_s: float = 0.0
    transform_s: float = 0.0
    #: the consumer (the net's forward) waiting for the next batch
    wait_s: float = 0.0
    skipped: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))


_STOP = None


class DecoderPool:
    """``threads`` daemon threads running jobs in submission order (0: run them inline)."""

    def __init__(self, threads: int, name: str = "decoder"):
        if threads < 0:
            raise ValueError(f"decoder threads must be >= 0, got {threads}")
        self.threads = threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # daemon: a worker blocked on a slow file must not hold the interpreter's exit
        # the threads hold the queue, not the pool, so a pool dropped without close() is freed
        # and its __del__ stops them
        self._workers = [threading.Thread(target=_work, args=(self._jobs,), name=f"{name} {i}",
                                          daemon=True) for i in range(threads)]
        for t in self._workers:
            t.start()

    def run(self, jobs: list[Callable[[], None]]) -> Pending:
        """Start ``jobs``; the returned Pending says when they are done."""
        pending = Pending(len(jobs))
        if not self._workers:
            for job in jobs:
                _run_one(job, pending)
            return pending
        for job in jobs:
            self._jobs.put((job, pending))
        return pending

    def close(self, timeout: float = 30.0) -> None:
        """Stop the threads after the jobs already queued (idempotent). A thread still busy
        after ``timeout`` is left to end with the process (it is a daemon)."""
        workers, self._workers = self._workers, []
        for _ in workers:
            self._jobs.put(_STOP)
        for t in workers:
            if t is not threading.current_thread():
                t.join(timeout)

    def __del__(self) -> None:
        for _ in self._workers:
            self._jobs.put(_STOP)


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        job, pending = item
        _run_one(job, pending)
        del job, pending, item  # drop the batch before blocking on the next job


def _run_one(job: Callable[[], None], pending: Pending) -> None:
    if pending.cancelled:
        pending._finish(None)
        return
    try:
        job()
    except BaseException as e:  # handed to whoever waits on the batch
        pending._finish(e)
    else:
        pending._finish(None)
