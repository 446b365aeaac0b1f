"""`poseidon bench train`: local data-parallel workers beside PyTorch DDP (gloo)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from engine.comm.schemes import ENGINE_SCHEMES, NETWORK_SCHEMES, SCHEMES

from ..console import fail, user_errors
from ..options import parse_workers


@click.command("train")
@click.option("--workers", default="1,2,4", show_default=True, help="Local worker counts.")
@click.option("--scheme", "schemes", default=None,
              help="Schemes to run; a variant adds train options after a colon: "
              f"'ring:--fusion-mb=4', 'auto:--no-priority'; gloo and mpi are the collective "
              "engines (mpi: all ranks started by mpiexec). [default: "
              f"{','.join(s for s in SCHEMES if s not in ENGINE_SCHEMES)},hybrid,auto; only "
              "those that run between machines with --bandwidth, where every worker is a "
              "machine of its own]")
@click.option("--net", "nets", default="fc,conv", show_default=True,
              help="fc: FC-heavy (1.3 M parameters); conv: conv-heavy (66 K parameters).")
@click.option("--iters", type=int, default=240, show_default=True,
              help="Iterations a run; its rate is the median of the solver's display windows "
              "after the first third.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating runs of DDP and each scheme; medians are reported.")
@click.option("--bandwidth", default=None, metavar="BW",
              help="Run every worker (Poseidon's and DDP's) in a network namespace of its own "
              "with its link shaped to BW each way (10gbit, 1gbit; needs root), instead of "
              "loopback.")
@click.option("--trusted-network", is_flag=True,
              help="Every Poseidon run takes --trusted-network: auto may also plan the "
              "collective engines (gloo; mpi where MPI launched the workers).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def train(workers: str, schemes: str | None, nets: str, iters: int, repeats: int,
          bandwidth: str | None, trusted_network: bool, json_path: str | None) -> None:
    """Poseidon's workers against DDP on the same net and the same records."""
    from poseidon_cli.benches.comm import cpu_name_and_blas
    from poseidon_cli.benches.time import torch_available

    from .train import NETS, run

    if iters < 6:
        fail("--iters must be at least 6 (the first third is warm-up)")
    with user_errors():
        counts = parse_workers(workers)
        bits = None
        if bandwidth is not None:
            from engine.comm.link import parse_bandwidth
            from engine.perf.netns import ClusterError, check_root, cleanup_stale
            bits = parse_bandwidth(bandwidth)
            try:
                check_root()
            except ClusterError as e:
                fail(str(e))
            cleanup_stale()
    if schemes is None:
        schemes = ",".join([*(NETWORK_SCHEMES if bits else (
            s for s in SCHEMES if s not in ENGINE_SCHEMES)), "hybrid", "auto"])
    names = tuple(n.strip() for n in nets.split(",") if n.strip())
    for n in names:
        if n not in NETS:
            fail(f"--net {n!r}: choose from {', '.join(NETS)}")
    click.echo(f"machine: {cpu_name_and_blas()}; " + (
        f"every worker in a namespace, links shaped to {bandwidth} each way" if bits else
        "loopback: overheads, not a cluster"))
    ddp = torch_available()
    if not ddp:
        click.echo("PyTorch is not installed (pip install torch==2.13.0): Poseidon alone, no "
                   "DDP peer")
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-train-") as d, user_errors():
        # user_errors: also the data set's DataError (no scikit-learn: the digits)
        report = run(counts, [s.strip() for s in schemes.split(",") if s.strip()], iters,
                     Path(d), ddp, click.echo, names, repeats, bits,
                     ("--trusted-network",) if trusted_network else ())
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
