"""`poseidon bench elastic`: a machine taken away mid-run, elastic against stopping and
resuming from the newest snapshot by hand (poseidon_cli/benches/elastic.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..console import fail, user_errors
from ..options import namespaces_or_fail, parse_workers


@click.command("elastic")
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="The solver whose net to train (its data is not read: compute is replayed).")
@click.option("--trace", "trace_path", required=True, type=click.Path(dir_okay=False),
              help="Layer times to replay (poseidon-layer-trace or `poseidon time --json`).")
@click.option("--workers", default="4,8", show_default=True, help="Worker counts.")
@click.option("--bandwidth", default="10gbit", show_default=True,
              help="Each emulated host's link, each direction.")
@click.option("--time-scale", type=float, default=10.0, show_default=True,
              help="Every layer time x S, every link's bandwidth / S.")
@click.option("--commit-every", type=click.IntRange(min=1), default=10, show_default=True,
              help="K: the elastic run commits, and the run by hand snapshots, every K "
              "iterations.")
@click.option("--kill-at", type=click.IntRange(min=1), default=None,
              help="Take the machine away once rank 0 logs this iteration [default: 2K + K/2].")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="Both runs' --timeout (how long a silent peer may be silent).")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Alternating runs of each way; medians are reported.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def elastic(solver: str, trace_path: str, workers: str, bandwidth: str, time_scale: float,
            commit_every: int, kill_at: int | None, timeout: float, repeats: int,
            json_path: str | None) -> None:
    """Recovery time and iterations lost per failure, elastic and by hand."""
    from engine.comm.link import parse_bandwidth
    from engine.perf.netns import ClusterError


    from . import elastic as bench

    with user_errors():
        namespaces_or_fail()
        counts = parse_workers(workers)
        bits = parse_bandwidth(bandwidth)
    kill = kill_at or 2 * commit_every + commit_every // 2
    click.echo(f"emulated cluster: {bandwidth} per link each way (run at "
               f"{bits / time_scale / 1e6:g} Mbit/s with every layer time x {time_scale:g}); a "
               f"commit (elastic) or snapshot (by hand) every {commit_every} iterations; the "
               f"machine of a worker other than rank 0 is taken away at iteration {kill}; "
               f"times are wall seconds from the kill", err=True)
    click.echo(f"{'P':>3} {'way':>8} {'reached':>7} {'from':>5} {'lost':>5} {'resumed s':>9} "
               f"{'regained s':>10} {'s/iter':>7}")

    def say(r: bench.Recovery) -> None:
        click.echo(f"{r.workers:>3} {r.way:>8} {r.killed_at:>7} {r.resumed_from:>5} "
                   f"{r.lost:>5} {r.resumed_s:>9.2f} {r.regained_s:>10.2f} "
                   f"{r.iteration_s:>7.3f}")
        sys.stdout.flush()

    try:
        rows = bench.run_bench(Path(solver), counts, bits, Path(trace_path), time_scale,
                               commit_every, kill, timeout, repeats, say)
    except (bench.BenchError, ClusterError) as e:
        fail(str(e))
    report = {"solver": solver, "trace": trace_path, "bandwidth_bits_per_s": bits,
              "time_scale": time_scale, "commit_every": commit_every, "kill_at": kill,
              "timeout": timeout, **bench.summary(rows, commit_every)}
    for m in report["medians"]:
        e, h = m["elastic"], m["by hand"]
        click.echo(f"P={m['workers']}: medians of {repeats}: elastic regained in "
                   f"{e['regained_s']:.2f} s ({e['lost']:g} iterations lost), by hand in "
                   f"{h['regained_s']:.2f} s ({h['lost']:g} lost): {m['ratio_regained']:.1f}x; "
                   f"goal <= 5 s + one commit interval = {m['goal_s']:.2f} s: "
                   f"{'met' if m['goal_met'] else 'NOT met'}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
