"""nccl: the dense allreduce on NCCL, for GPU workers (CuPy's NCCL bindings).

Rank 0 draws the NCCL unique id and sends it in the authenticated ENGINE message; every worker
makes a communicator of its own per job (and per elastic generation). A unit's gradients never
leave the device: at release the training thread marks the compute stream with an event; the
progress thread gathers the unit's diffs into a device vector on the engine's own stream after
that event, the engine thread issues the allreduce on that stream, the wait thread waits for
the stream's event alone (never for the compute queue), and the sum goes back into the diffs
on the device (the update takes the mean). The algorithm is pinned (NCCL_ALGO=Ring,
NCCL_PROTO=Simple unless set) so that a rerun sums in the same order. Every engine thread
works on the worker's GPU.

NCCL refuses two ranks on one GPU, so one machine with one GPU tests only one rank's plumbing;
the multi-rank logic of the engine layer is the same as Gloo's and MPI's (collective.py).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import numpy as np

from ..units import Unit
from ..engines import Backend
from .collective import CollectiveScheme

PIN = (("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple"))


class NcclBackend(Backend):
    name = "nccl"
    install = "pip install 'poseidon[gpu]' (CuPy with NCCL)"
    on_device = True

    @classmethod
    def missing(cls, on_gpu: bool) -> str:
        if not on_gpu:
            return "NCCL sums GPU gradients: the workers train on the CPU (give --gpu/--gpus)"
        if importlib.util.find_spec("cupy") is None:
            return f"CuPy is not installed: {cls.install}"
        try:
            from cupy.cuda import nccl
            nccl.get_version()
        except (ImportError, AttributeError, RuntimeError) as e:
            return f"CuPy has no NCCL here ({e}): {cls.install}"
        return ""

    @classmethod
    def version(cls) -> str:
        import cupy
        from cupy.cuda import nccl
        v = nccl.get_version()
        return f"NCCL {v // 10000}.{v // 100 % 100}.{v % 100}, cupy {cupy.__version__}"

    @classmethod
    def algorithm(cls) -> str:
        return ", ".join(f"{var}={os.environ.get(var, value)}" for var, value in PIN)

    @classmethod
    def setup(cls, address: str, world: int, timeout: float) -> tuple[bytes, Any]:
        from cupy.cuda import nccl
        return bytes(b % 256 for b in nccl.get_unique_id()), None

    @classmethod
    def thread_context(cls) -> Callable[[], None]:
        import cupy
        device = cupy.cuda.Device().id  # the worker's GPU, on the thread that joins

        def use() -> None:
            cupy.cuda.Device(device).use()
        return use

    def __init__(self, setup: bytes, rank: int, world: int, address: str,
                 timeout: float) -> None:
        import cupy
        from cupy.cuda import nccl
        for var, value in PIN:
            os.environ.setdefault(var, value)
        self.cupy, self.nccl = cupy, nccl
        self.device = cupy.cuda.Device().id  # the engine thread's: the worker's GPU
        self.stream = cupy.cuda.Stream()  # blocking: ordered after the default stream's work
        try:  # CuPy 14 takes the id as the bytes get_unique_id gives
            self.comm = nccl.NcclCommunicator(world, setup, rank)
        except TypeError:  # (raised converting the argument, before NCCL is called)
            # CuPy 13 and older: a tuple of signed chars
            self.comm = nccl.NcclCommunicator(
                world, tuple(b - 256 if b > 127 else b for b in setup), rank)

    def start(self, vec: Any) -> Any:
        dtype = {np.dtype("float32"): self.nccl.NCCL_FLOAT32,
                 np.dtype("float64"): self.nccl.NCCL_FLOAT64}[vec.dtype]
        with self.cupy.cuda.Device(self.device):  # whichever thread issues it
            self.comm.allReduce(vec.data.ptr, vec.data.ptr, vec.size, dtype,
                                self.nccl.NCCL_SUM, self.stream.ptr)
            done = self.cupy.cuda.Event(block=True, disable_timing=True)
            done.record(self.stream)
        return done

    def then(self, handle: Any, done: Callable[[BaseException | None], None]) -> bool:
        return False  # the wait thread waits for the stream's event

    def finish(self, handle: Any) -> None:
        handle.synchronize()

    def close(self) -> None:
        self.comm.destroy()


class Nccl(CollectiveScheme):
    name = "nccl"
    backend = NcclBackend

    def __init__(self, host: Any, units: Any, chunk_bytes: int, groups: Any = None,
                 mine: int = 0) -> None:
        super().__init__(host, units, chunk_bytes, groups, mine)
        import cupy
        self.cupy = cupy
        self._device: dict[int, Any] = {}

    def capture(self, unit: Unit, rnd: int, bits: int) -> Any:
        # on the training thread: the compute stream's work up to this release
        mark = self.cupy.cuda.Event(block=False, disable_timing=True)
        mark.record()
        return mark

    def start(self, unit: Unit, rnd: int, bits: int, captured: Any) -> None:
        backend = self.collective.backend
        vec = self._device.get(unit.id)
        if vec is None:
            dtype = unit.params[0].blob.diff.dtype
            vec = self._device[unit.id] = self.cupy.empty(unit.count, dtype)
        with backend.stream:
            backend.stream.wait_event(captured)
            offset = 0
            for p in unit.params:
                n = int(p.blob.diff.size)
                vec[offset:offset + n] = p.blob.diff.reshape(-1)
                offset += n
        def finish(total: Any, agreed: int) -> None:
            offset = 0
            for p in unit.params:
                n = int(p.blob.diff.size)
                p.blob.diff[...] = total[offset:offset + n].reshape(p.blob.diff.shape)
                offset += n
            self.host.done(unit, rnd, agreed)

        self.sum_vector(unit, rnd, 0, vec, bits, finish)

    def signal_vector(self, values: list[float]) -> Any:
        with self.collective.backend.stream:
            return self.cupy.asarray(values, np.float32)

    def on_host(self, summed: Any) -> Any:
        return self.cupy.asnumpy(summed)
