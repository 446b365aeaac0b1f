"""The synchronisation schemes, one module each, behind one interface (base.Scheme).

A new scheme is one module here plus one line in ``SCHEMES``: the planner prices it with its
``timing``, the syncer schedules its units, and the transport counts its bytes under its name.
"""
from __future__ import annotations

from .base import Finished, Scheme
from .gloo import Gloo
from .halving_doubling import HalvingDoubling
from .mpi import Mpi
from .nccl import Nccl
from .ps import PS
from .ring import Ring
from .sfb import SFB
from .shm import Shm

SCHEMES: dict[str, type[Scheme]] = {s.name: s for s in (PS, SFB, Ring, HalvingDoubling, Shm,
                                                        Gloo, Mpi, Nccl)}
#: Poseidon's own schemes that run between machines (what `simulate` models and the emulated
#: cluster runs)
NETWORK_SCHEMES = tuple(name for name, s in SCHEMES.items() if not s.one_machine and not s.engine)
#: the collective engines (schemes/collective.py): planned only where the job trusts its network
ENGINE_SCHEMES = tuple(name for name, s in SCHEMES.items() if s.engine)

__all__ = ["ENGINE_SCHEMES", "NETWORK_SCHEMES", "SCHEMES", "Finished", "Scheme"]
