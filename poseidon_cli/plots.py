"""Speedup plots (`simulate --plot`, `bench cluster --plot`): speedup against workers, one curve
per scheme, a predicted curve dotted in its measured curve's colour, and linear scaling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Curve:
    """One scheme's speedups at its worker counts; ``predicted``: the model's, beside them."""
    label: str
    workers: Sequence[int]
    speedup: Sequence[float]
    predicted: Sequence[float] | None = None


def plot_speedup(curves: Sequence[Curve], path: str, title: str,
                 ylabel: str = "speedup") -> bool:
    """Write the plot to ``path``; False (nothing written) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4.5))
    workers = sorted({w for c in curves for w in c.workers})
    ax.plot(workers, workers, "k--", label="linear")
    for c in curves:
        line, = ax.plot(c.workers, c.speedup, marker="o",
                        label=c.label if c.predicted is None else f"{c.label} measured")
        if c.predicted is not None:
            ax.plot(c.workers, c.predicted, ls=":", color=line.get_color(),
                    label=f"{c.label} predicted")
    ax.set_xlabel("workers")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
