"""`poseidon bench cluster`: the emulated cluster (poseidon_cli/benches/cluster.py) from the command line."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from ..console import fail, user_errors
from ..plots import Curve, plot_speedup
from ..options import NO_MATPLOTLIB, check_plot, namespaces_or_fail, parse_workers


@click.command("cluster")
@click.option("--solver", required=True, type=click.Path(dir_okay=False),
              help="The solver whose net to train (its data is not read with --compute replay).")
@click.option("--workers", default="1,2,4,8", show_default=True, help="Worker counts: 1,2,4,8.")
@click.option("--scheme", "schemes", default="ps,hybrid", show_default=True,
              help="Schemes to run: ps, sfb, ring, hd, hybrid, auto; a variant adds train options "
              "after a colon: 'ps:--no-priority', 'ring:--fusion-mb=4'.")
@click.option("--bandwidth", default="10gbit", show_default=True,
              help="Each emulated host's link, each direction.")
@click.option("--compute", type=click.Choice(["replay", "real"]), default="replay",
              show_default=True, help="Replay a trace's layer times, or really compute (small "
              "nets).")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Layer times to replay (poseidon-layer-trace or `poseidon time --json`).")
@click.option("--time-scale", type=float, default=50.0, show_default=True,
              help="Replay: every layer time x S, every link's bandwidth / S.")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="Workers per emulated host (they share its link; with more than one the run "
              "reduces inside each host first, unless a variant says --no-levels).")
@click.option("--iters", type=int, default=6, show_default=True, help="Measured iterations.")
@click.option("--warmup", type=int, default=3, show_default=True,
              help="Iterations before the measurement starts.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every row and the summary here.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Measured and predicted speedup against workers, as a PNG.")
def cluster(solver: str, workers: str, schemes: str, bandwidth: str, compute: str,
            trace_path: str | None, time_scale: float, slots: int, iters: int, warmup: int,
            json_path: str | None, plot: str | None) -> None:
    """Real workers in network namespaces over shaped links, next to `simulate`'s prediction."""
    check_plot(plot)
    from engine.comm.link import parse_bandwidth
    from engine.perf.netns import ClusterError

    from . import cluster as bench

    if compute == "replay" and trace_path is None:
        fail("--compute replay needs --trace (layer times to replay)")
    if iters < 2 or warmup < 1:
        fail("--iters must be at least 2 and --warmup at least 1")
    with user_errors():
        namespaces_or_fail()
        counts = parse_workers(workers)
        wanted = [s.strip() for s in schemes.split(",") if s.strip()]
        bits = parse_bandwidth(bandwidth)
        scale = time_scale if compute == "replay" else 1.0
        click.echo(f"emulated cluster: {bandwidth} per link each way"
                   + (f" (run at {bits / scale / 1e6:g} Mbit/s with every layer time x "
                      f"{scale:g}; times below are divided by {scale:g})" if scale != 1 else "")
                   + f"; compute: {compute}" + (f" from {trace_path}" if trace_path else ""),
                   err=True)
        header = (f"{'P':>3} {'scheme':>7} {'iter ms':>9} {'predicted':>9} {'error':>7} "
                  f"{'img/s':>8} {'speedup':>7} {'pred.':>6} {'MB/worker':>9} {'MB/host':>8} "
                  f"{'hidden':>6} {'CPU':>5}")
        click.echo(header)

        def say(m: bench.Measurement) -> None:
            note = "  CPU-bound: not a cluster measurement" if m.cpu_bound else ""
            cpu = "-" if math.isnan(m.cpu_utilisation) else f"{m.cpu_utilisation:.0%}"
            wire = "-" if m.wire_bytes_per_host is None else f"{m.wire_bytes_per_host / 1e6:.2f}"
            click.echo(f"{m.workers:>3} {m.scheme:>7} {m.iteration_s * 1e3:>9.1f} "
                       f"{m.predicted_s * 1e3:>9.1f} {m.error:>+7.1%} {m.images_per_s:>8.1f} "
                       f"{m.speedup:>7.2f} {m.predicted_speedup:>6.2f} "
                       f"{m.bytes_per_node / 1e6:>9.2f} {wire:>8} {m.hidden_fraction:>6.0%} "
                       f"{cpu:>5}{note}")
            split = m.cpu_s_per_iter
            if split:  # where rank 0's CPU went, apart from the compute it serves
                click.echo("    rank 0 CPU per iteration: " + ", ".join(
                    f"{k} {split[k] * 1e3:.1f} ms" for k in
                    ("training", "progress", "transport", "other", "shard") if k in split))
            sys.stdout.flush()

        try:
            bad = [n for n in counts if n > 1 and n % slots]
            if bad:
                fail(f"--workers {bad[0]} is not a multiple of --slots {slots}")
            rows = bench.run_bench(Path(solver), counts, wanted, bits, compute,
                                   Path(trace_path) if trace_path else None, time_scale, iters,
                                   warmup, say, slots=slots)
        except (bench.BenchError, ClusterError) as e:
            fail(str(e))
        report = {"solver": solver, "bandwidth_bits_per_s": bits, "compute": compute,
                  "slots": slots,
                  "trace": trace_path, "time_scale": scale, "iters": iters, "warmup": warmup,
                  **bench.summary(rows)}
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
        title = f"{Path(solver).parent.name}, {bandwidth}, compute {compute}"
        if plot and not plot_speedup(_curves(rows), plot, title):
            click.echo(f"{NO_MATPLOTLIB}; {plot} was not written (the measurements above "
                       "stand)")


def _curves(rows: list) -> list[Curve]:
    """Each scheme's measured and predicted speedups, from the one-worker row up."""
    one = [r for r in rows if r.workers == 1]
    curves = []
    for scheme in dict.fromkeys(r.scheme for r in rows if r.workers > 1):
        sel = one + [r for r in rows if r.scheme == scheme]
        curves.append(Curve(scheme, [r.workers for r in sel], [r.speedup for r in sel],
                            [r.predicted_speedup for r in sel]))
    return curves
