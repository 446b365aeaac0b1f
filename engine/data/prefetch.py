"""A background thread that keeps the next batches of a data layer ready.

The loader is a pure function of a stream position (``load(pos)`` returns the batch that
starts there), so prefetching cannot change results: the thread computes
``load(start)``, ``load(start + step)``, ... in order into a bounded queue, each tagged with
its position, and the consumer checks the tag. ``reset(pos)`` (a seek) stops the thread,
throws away what it had made and starts again at ``pos``: no stale batch can be used.
An exception in the thread is re-raised by ``get`` in the caller's thread. A batch thrown
away (by a seek or close) goes to ``discard``, which can stop work still being done on it.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """Bounded-queue producer of ``load(start + i * step)`` for i = 0, 1, ...; thread-safe get."""

    def __init__(self, load: Callable[[int], T], start: int, step: int, depth: int = 4,
                 name: str = "prefetch", discard: Callable[[T], None] | None = None):
        if depth < 1:
            raise ValueError("prefetch depth must be >= 1")
        # Held weakly when it is a bound method (a layer's is): a layer dropped without close()
        # is then freed at once, which stops its thread (__del__), with no cycle to wait for.
        self._load_ref: Callable[[], Callable[[int], Any] | None] = (
            weakref.WeakMethod(load) if hasattr(load, "__self__") else (lambda: load))
        self._step = step
        self._depth = depth
        self._name = name
        self._discard = discard
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._next = start
        self._start(start)

    def _start(self, start: int) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._depth)
        self._next = start
        self._thread = threading.Thread(
            target=_produce,
            args=(self._load_ref, start, self._step, self._stop, self._queue, self._discard),
            name=self._name, daemon=True)
        self._thread.start()

    def get(self) -> tuple[int, T]:
        """(position, batch) of the next batch in order; raises what the loader raised."""
        if self._thread is None:
            raise RuntimeError(f"{self._name}: prefetcher is closed")
        pos, value, error = self._queue.get()
        if error is not None:
            self._halt()
            self._thread = None
            raise error
        if pos != self._next:  # cannot happen: one producer, FIFO; guards against misuse
            raise RuntimeError(f"{self._name}: expected batch at {self._next}, got {pos}")
        self._next = pos + self._step
        return pos, value

    def reset(self, start: int) -> None:
        """Drop every prepared batch and continue from ``start``."""
        self._halt()
        self._start(start)

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        while self._discard is not None:
            try:
                _, value, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            if value is not None:
                self._discard(value)

    def close(self) -> None:
        """Stop the thread (idempotent)."""
        self._halt()
        self._thread = None

    def __del__(self) -> None:
        self._stop.set()


def _produce(load_ref: Callable[[], Callable[[int], Any] | None], pos: int, step: int,
             stop: threading.Event, out: queue.Queue,
             discard: Callable[[Any], None] | None) -> None:
    while not stop.is_set():
        load = load_ref()
        if load is None:  # the owner is gone
            return
        try:
            item = (pos, load(pos), None)
        except BaseException as e:  # handed to the consumer, which raises it
            item = (pos, None, e)
        del load
        delivered = False
        while not stop.is_set() and load_ref() is not None:
            try:
                out.put(item, timeout=0.05)
                delivered = True
                break
            except queue.Full:
                pass
        if not delivered:  # stopped, or the owner is gone
            if discard is not None and item[1] is not None:
                discard(item[1])
            return
        if item[2] is not None:
            return
        pos += step
