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

    def resolve(self, path: str) -> Path:
        """Caffe users run from CAFFE_ROOT: try the naming file's folder, then the cwd."""
        p = Path(path)
        if p.is_absolute():
            return p
        for base in self.base_dirs:
            cand = base / p
            if cand.exists():
                return cand
        return Path.cwd() / p if not self.base_dirs else self.base_dirs[0] / p
