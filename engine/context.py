"""RunContext: what a layer may need to know about the run it is part of."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunContext:
    """Per-process facts the Net hands every layer (data layers use rank and world_size to
    read their own part of the data; relative paths resolve against ``base_dirs``)."""

    rank: int = 0
    world_size: int = 1
    #: directories to resolve a relative path against, in order (the file that named it, then cwd)
    base_dirs: list[Path] = field(default_factory=list)

    def candidates(self, path: str) -> list[Path]:
        """Where a relative path may be, in the order it is looked for (what an error about a
        missing file names)."""
        p = Path(path)
        if p.is_absolute():
            return [p]
        return [base / p for base in self.base_dirs] or [Path.cwd() / p]

    def resolve(self, path: str) -> Path:
        """Caffe users run from CAFFE_ROOT: try the naming file's folder, then the cwd."""
        places = self.candidates(path)
        return next((cand for cand in places if cand.exists()), places[0])
