"""mpi: the dense allreduce on the MPI runtime that started the job (mpiexec, mpirun, srun).

MPI's world is the job's workers: rank r of ``mpiexec -n P poseidon train --comm mpi`` is
worker r (launch/managers.py reads the same rank from PMI's or Open MPI's variables), and
each job takes a communicator of its own (a duplicate of MPI_COMM_WORLD). Collectives are
blocking, issued in the job's one order by the engine thread, or, for a small layer whose turn
it is, by the training thread at release (``inline_bytes``: the sum takes less than the
hand-off would, and the update is applied there too). MPI is initialised at
MPI_THREAD_MULTIPLE: at FUNNELED, MPICH's progress loop
busy-polls without yielding, and with more ranks than cores one process's spin starves the
others (measured on 2 cores, 3 ranks: a 1 MB allreduce took 784 ms at FUNNELED, 1.7 ms at
MULTIPLE).

The reduction algorithm is pinned before MPI starts, so that a rerun sums in the same order and
every rank gets the same bits: the ring (MPICH: MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring; Open
MPI: coll_tuned's allreduce algorithm 4), unless the user set those variables, in which case
theirs is used and recorded. MPI's world is fixed when the launcher starts it: an elastic job
cannot use it. Needs mpi4py and an MPI runtime (``pip install 'poseidon[mpi]'`` installs MPICH
from PyPI; a cluster's own MPI works as well).
"""
from __future__ import annotations

import atexit
import importlib.util
import os
from typing import Any, Callable

from ..engines import Backend, EngineError
from .collective import CollectiveScheme

#: a process an MPI launcher started has one of these (PMI: MPICH, Intel MPI, srun; PMIx and
#: Open MPI's own)
LAUNCHED = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")
#: the ring allreduce, per family: (variable, value) pairs set unless the user set them
PIN = {"MPICH": (("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", "ring"),),
       "Open MPI": (("OMPI_MCA_coll_tuned_use_dynamic_rules", "1"),
                    ("OMPI_MCA_coll_tuned_allreduce_algorithm", "4"))}
#: False once a job's collective failed or was left unfinished: MPI_Finalize would wait for it
_finalize_at_exit = True


def _mpi() -> Any:
    import mpi4py
    mpi4py.rc.initialize = False  # started on first use, after the algorithm is pinned
    mpi4py.rc.finalize = False    # ours (at exit, when no collective is left hanging)
    from mpi4py import MPI
    return MPI


def _family() -> str:
    text = _mpi().Get_library_version()
    return "Open MPI" if "Open MPI" in text else "MPICH"


class MpiBackend(Backend):
    name = "mpi"
    blocking = True
    #: here a thread hand-off costs 100-400 us on busy cores, what MPICH sums 256 KB in
    inline_bytes = 256 << 10
    install = "pip install 'poseidon[mpi]' (mpi4py and MPICH)"

    @classmethod
    def missing(cls, on_gpu: bool) -> str:
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed: {cls.install}"
        try:
            _mpi().Get_library_version()
        except (ImportError, RuntimeError) as e:  # mpi4py without an MPI library to load
            return f"mpi4py finds no MPI library ({e}): {cls.install}"
        if not any(os.environ.get(v, "").strip() for v in LAUNCHED):
            return ("this process was not started by an MPI launcher: start the job with "
                    "`mpiexec -n N poseidon train ... --comm mpi` (or mpirun, srun --mpi=pmi2)")
        return ""

    @classmethod
    def version(cls) -> str:
        import mpi4py
        first = _mpi().Get_library_version().strip().splitlines()[0]
        library = " ".join(first.replace("Version:", "").split(",")[0].split())
        return f"{library}, mpi4py {mpi4py.__version__}"

    @classmethod
    def algorithm(cls) -> str:
        pins = PIN[_family()]
        return ", ".join(f"{var}={os.environ.get(var, value)}" for var, value in pins)

    def __init__(self, setup: bytes, rank: int, world: int, address: str,
                 timeout: float) -> None:
        MPI = init_mpi()
        world_comm = MPI.COMM_WORLD
        if (world_comm.Get_rank(), world_comm.Get_size()) != (rank, world):
            raise EngineError(
                f"MPI's world has {world_comm.Get_size()} ranks and this is its rank "
                f"{world_comm.Get_rank()}, but this worker is rank {rank} of {world}: start "
                "every worker with one `mpiexec -n N poseidon train ... --comm mpi`")
        self.comm = world_comm.Dup()
        # bound once: a small layer's round pays for each lookup
        self._allreduce, self._in_place, self._sum = self.comm.Allreduce, MPI.IN_PLACE, MPI.SUM

    def start(self, vec: Any) -> None:
        self._allreduce(self._in_place, vec, self._sum)

    def then(self, handle: Any, done: Callable[[BaseException | None], None]) -> bool:
        done(None)  # blocking: complete already, reported from the engine thread
        return True

    def close(self) -> None:
        self.comm.Free()

    @classmethod
    def abandon(cls) -> None:
        global _finalize_at_exit
        _finalize_at_exit = False


def init_mpi() -> Any:
    """mpi4py's MPI, started (once per process) with the ring allreduce pinned."""
    MPI = _mpi()
    if not MPI.Is_initialized():
        for var, value in PIN[_family()]:
            os.environ.setdefault(var, value)
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(_finalize)
    return MPI


def _finalize() -> None:
    MPI = _mpi()
    if _finalize_at_exit and not MPI.Is_finalized():
        MPI.Finalize()


class Mpi(CollectiveScheme):
    name = "mpi"
    backend = MpiBackend
    elastic = False
