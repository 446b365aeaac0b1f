"""`poseidon bench shard`: the PS shard's aggregation throughput with N summing threads
against today's server (threads=0), in the same run."""
from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ..options import parse_size
from ..console import fail, user_errors


@click.command("shard")
@click.option("--layouts", default="vgg,resnet", show_default=True,
              help="vgg: VGG-16 less fc6, 142 MB in large chunks; resnet: ResNet-50, 102 MB, "
              "many small chunks.")
@click.option("--threads", default="0,1,2,4", show_default=True,
              help="Summing threads to compare (0, today's server, is always measured).")
@click.option("--workers", type=int, default=4, show_default=True,
              help="Synthetic worker processes pushing to the shard.")
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Alternating measurements per thread count (the median is printed).")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Rounds per measurement.")
@click.option("--wire", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--chunk-bytes", default="4M", show_default=True,
              help="Largest chunk (as `poseidon train --chunk-bytes`).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every row (with its samples) here.")
def shard(layouts: str, threads: str, workers: int, repeats: int, rounds: int, wire: str,
          chunk_bytes: str, json_path: str | None) -> None:
    """A real shard process and P worker processes on loopback: bytes summed per second."""
    from poseidon_cli.benches.comm import cpu_name_and_blas
    from poseidon_cli.benches.shard import LAYOUTS, run

    with user_errors():
        names = [n.strip() for n in layouts.split(",") if n.strip()]
        unknown = [n for n in names if n not in LAYOUTS]
        if not names or unknown:
            raise ValueError(f"--layouts: expected some of {', '.join(LAYOUTS)}, got {layouts!r}")
        try:
            wanted = sorted({int(t) for t in threads.split(",") if t.strip()})
        except ValueError:
            raise ValueError(f"--threads: expected numbers such as 0,1,2,4, got {threads!r}") from None
        if any(t < 0 for t in wanted):
            raise ValueError(f"--threads must be >= 0, got {threads!r}")
        if workers < 2 or repeats < 1 or rounds < 1:
            raise ValueError("--workers must be at least 2, --repeats and --rounds at least 1")
        size = parse_size(chunk_bytes)
    click.echo(f"machine: {cpu_name_and_blas()}; loopback")
    click.echo(f"measured: one shard process holding the whole layout, {workers} worker "
               f"processes on the same {os.cpu_count()} cores; a round = every worker pushes "
               "every chunk and gets every sum back (authenticated both ways)")
    click.echo("the workers' own costs share those cores: the ratios are this machine's, not a "
               "shard's with cores of its own; the shard's CPU per round is its own cost")
    click.echo(f"{'layout':>7} {'threads':>7} {'chunks':>6} {'MB':>6} {'round ms':>9} "
               f"{'rounds/s':>8} {'summed GB/s':>11} {'ratio':>6} {'shard cpu ms':>12} "
               f"{'GB/cpu-s':>8}")

    def say(r) -> None:
        click.echo(f"{r.layout:>7} {r.threads:>7} {r.chunks:>6} {r.bytes / 1e6:>6.0f} "
                   f"{r.round_s * 1e3:>9.1f} {r.rounds_per_s:>8.2f} {r.summed_gb_s:>11.2f} "
                   f"{r.ratio:>6.2f} {r.shard_cpu_s * 1e3:>12.0f} {r.gb_per_cpu_s:>8.2f}")

    try:
        rows = run(names, wanted, workers, repeats, rounds,
                   "<f4" if wire == "fp32" else "<f2", size, say)
    except (RuntimeError, OSError) as e:
        fail(f"bench shard: {e}")
    click.echo(f"medians of {repeats} measurements of {rounds} rounds each; ratio: summed GB/s "
               "against threads=0 in the same run; shard cpu: the shard process's CPU time per "
               "round, all threads; GB/cpu-s: bytes summed per second of it")
    from poseidon_cli.benches.shard import add_bytes_per_s
    adds = add_bytes_per_s(size)
    click.echo(f"for scale: one thread adds {size}-byte pushes in place at {adds / 1e9:.1f} GB/s "
               "(no network); a 10 GbE link brings a shard 1.25 GB/s")
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"machine": cpu_name_and_blas(), "cores": os.cpu_count(), "workers": workers,
             "wire": wire, "chunk_bytes": size, "repeats": repeats, "rounds": rounds,
             "add_bytes_per_s_one_thread": adds,
             "rows": [r.as_dict() for r in rows]}, indent=1) + "\n")
