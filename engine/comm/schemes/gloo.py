"""gloo: the dense allreduce on Gloo, PyTorch's CPU collective engine (DDP's and Horovod's).

torch.distributed's ProcessGroupGloo is built for each job (and each elastic generation) from
the job's own rendezvous: rank 0 serves a TCP store on a fresh port of its host address and
sends that address in the authenticated ENGINE message; each group's keys live under a prefix
of the plan's nonce, so nothing of another job or generation is read. Every worker's Gloo
device listens on the address its host table lists. The sums are zero-copy on the NumPy
vectors (``torch.from_numpy``), in Gloo's ring algorithm, which sums each segment once and
hands every worker the same bits. Needs PyTorch (``pip install 'poseidon[gloo]'``; the CPU
build suffices, see the README).
"""
from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Any, Callable

from ..engines import Backend
from .collective import CollectiveScheme


def _torch() -> tuple[Any, Any]:
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # not c10d's notes on host names
    import torch
    import torch.distributed as dist
    return torch, dist


class GlooBackend(Backend):
    name = "gloo"
    install = ("pip install 'poseidon[gloo]' (PyTorch; its CPU build is enough: "
               "pip install torch --index-url https://download.pytorch.org/whl/cpu)")

    @classmethod
    def missing(cls, on_gpu: bool) -> str:
        if importlib.util.find_spec("torch") is None:
            return f"PyTorch is not installed: {cls.install}"
        _, dist = _torch()
        if not (dist.is_available() and dist.is_gloo_available()):
            return "this PyTorch was built without torch.distributed's Gloo"
        return ""

    @classmethod
    def version(cls) -> str:
        torch, _ = _torch()
        return f"torch {torch.__version__}"

    @classmethod
    def algorithm(cls) -> str:
        return "ring"

    @classmethod
    def setup(cls, address: str, world: int, timeout: float) -> tuple[bytes, Any]:
        _, dist = _torch()
        store = dist.TCPStore(address, 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        # a prefix of its own: a group reads no key of another job's or generation's
        return f"{address}:{store.port}/poseidon-{os.urandom(8).hex()}/".encode(), store

    def __init__(self, setup: bytes, rank: int, world: int, address: str,
                 timeout: float) -> None:
        torch, dist = _torch()
        self.torch = torch
        where, prefix = setup.decode().split("/", 1)
        host, port = where.rsplit(":", 1)
        wait = datetime.timedelta(seconds=timeout)
        self.store = dist.TCPStore(host, int(port), None, False, timeout=wait)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = wait
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), rank, world,
                                           opts)

    def start(self, vec: Any) -> Any:
        return self.group.allreduce([self.torch.from_numpy(vec)])

    def then(self, handle: Any, done: Callable[[BaseException | None], None]) -> bool:
        # Gloo's own thread reports the completion: no thread of ours wakes to wait for it
        def report(future: Any) -> None:
            try:
                future.value()
            except Exception as e:
                done(e)
                return
            done(None)
        handle.get_future().add_done_callback(report)
        return True

    def finish(self, handle: Any) -> None:
        handle.wait()  # without the GIL, bounded by the group's timeout (the job's)

    def close(self) -> None:
        self.group = None
        self.store = None


class Gloo(CollectiveScheme):
    name = "gloo"
    backend = GlooBackend
