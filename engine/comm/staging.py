"""Device-to-host staging of a unit's gradients, overlapping the backward of the layers below.

On a GPU a unit's gradients must reach host memory before a scheme can send them. Copied on
the training thread's own stream, the copy would queue behind the backward already launched,
block that thread until the GPU drained, and leave the GPU idle while it ran. Instead, at
release, the training thread marks the compute stream with an event and queues the copy on a
stream of its own that waits for that event, into page-locked host memory, so the copy engine
moves the bytes while the compute stream goes on with the layers below. The progress thread
waits for the copy's event alone, never for the GPU's queue, before the scheme reads the vector.

The sum comes back the same way (``scatter``): the host writes it into the unit's vector,
the copy stream takes it to the diffs, and the compute stream waits for that copy's event
before the update that follows, so no thread blocks on the copy and the copy engine, not the
compute stream, moves the bytes.

One vector per unit, reused every round: a round's copy is queued at release, and the unit's
previous round was applied before that (the solver waits for it before the layer's forward),
so no round reads a vector the next one writes; a round's copy out queues on the copy stream
behind the previous round's copy back, which has therefore read the vector. Host arrays need
no staging (``begin`` returns None and the scheme gathers them as before).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .units import Unit


@dataclass
class Staged:
    """One round's copy in flight: ``vec`` holds the unit's gradients once ``finished`` has
    happened; ``started`` marks when the copy stream began it (both CUDA events, timed)."""
    vec: np.ndarray
    started: Any
    finished: Any
    #: device arrays the copy reads that nothing else holds (contiguous copies of strided diffs)
    keep: tuple[Any, ...] = ()

    def wait(self) -> np.ndarray:
        """The unit's gradients on the host (blocks until the copy is done, not the GPU)."""
        self.finished.synchronize()
        self.keep = ()
        return self.vec

    def copy_ms(self) -> float:
        """How long the copy itself took on the device (after ``wait``)."""
        import cupy
        return float(cupy.cuda.get_elapsed_time(self.started, self.finished))


class Staging:
    """Per scheme instance: a copy stream per device and a page-locked vector per unit."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._vectors: dict[int, np.ndarray] = {}
        #: per unit, the stream its gradients were computed on (the update's, too)
        self._compute: dict[int, Any] = {}

    def begin(self, unit: Unit) -> Staged | None:
        """On the training thread at release: queue the copy of ``unit``'s gradients to the
        host behind what the compute stream has queued so far; None for host arrays."""
        params = unit.params
        if not params or isinstance(params[0].blob.diff, np.ndarray):  # (no call: each round)
            return None
        diffs = [p.blob.diff for p in params]
        import cupy
        device = diffs[0].device
        with device:
            flat = tuple(d if d.flags.c_contiguous else cupy.ascontiguousarray(d) for d in diffs)
            stream = self._streams.get(device.id)
            if stream is None:
                stream = self._streams[device.id] = cupy.cuda.Stream(non_blocking=True)
            vec = self._vectors.get(unit.id)
            if vec is None:
                dtype = np.dtype(diffs[0].dtype)
                count = sum(int(d.size) for d in diffs)
                memory = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
                vec = self._vectors[unit.id] = np.frombuffer(memory, dtype, count)
            ready = cupy.cuda.Event()
            compute = self._compute[unit.id] = cupy.cuda.get_current_stream()
            ready.record(compute)  # the gradients are final once the compute stream gets here
            stream.wait_event(ready)
            started, finished = cupy.cuda.Event(), cupy.cuda.Event()
            started.record(stream)
            address = vec.ctypes.data
            for d in flat:
                cupy.cuda.runtime.memcpyAsync(address, d.data.ptr, d.nbytes,
                                              cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                address += d.nbytes
            finished.record(stream)
        keep = tuple(f for f, d in zip(flat, diffs) if f is not d)
        return Staged(vec, started, finished, keep)

    def scatter(self, unit: Unit, total: np.ndarray, vec: np.ndarray) -> bool:
        """At the end of a staged round (any thread): ``total`` into ``vec``, and from
        there to the unit's diffs on the copy stream, the compute stream waiting for it.
        False where the caller must scatter (a vector not staged here, strided diffs)."""
        diffs = [p.blob.diff for p in unit.params]
        if self._vectors.get(unit.id) is not vec or not all(d.flags.c_contiguous
                                                             for d in diffs):
            return False
        import cupy
        if total is not vec:
            vec[...] = total
        device = diffs[0].device
        with device:
            stream = self._streams[device.id]
            address = vec.ctypes.data
            for d in diffs:
                cupy.cuda.runtime.memcpyAsync(d.data.ptr, address, d.nbytes,
                                              cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
                address += d.nbytes
            arrived = cupy.cuda.Event()
            arrived.record(stream)
            self._compute[unit.id].wait_event(arrived)
        return True
