"""`poseidon simulate`: how a net will scale, before renting the machines.

Per-layer times (a trace, `poseidon time --json`, or an estimate from the net's FLOPs), the
net's shapes, a link (bandwidth and latency, or the alpha and beta `poseidon bench comm`
fitted), and the DAG model of engine/perf/dag.py give, per scheme and number of workers, the
iteration time, the communication left exposed, images/s, speedup and efficiency. With
``--measured-comm`` a distributed run's trace gives each layer's communication time instead of
the link model, and its measured iteration is printed beside the recurrence's.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any, Sequence

import click

from engine.comm.schemes import NETWORK_SCHEMES

from ..console import fail, user_errors
from ..options import NO_MATPLOTLIB, check_plot, parse_shape, parse_workers
from ..plots import Curve, plot_speedup





@click.command("simulate")
@click.option("--model", required=True, type=click.Path(dir_okay=False),
              help="Net (or solver) prototxt: layer shapes and parameter sizes.")
@click.option("--trace", "trace_path", type=click.Path(dir_okay=False), default=None,
              help="Per-layer times: a poseidon-layer-trace JSON or `poseidon time --json`.")
@click.option("--estimate", is_flag=True,
              help="No trace: estimate layer times from FLOPs on the paper's GPU (Titan X).")
@click.option("--batch", type=int, default=None, help="Images per worker (default: the net's).")
@click.option("--input-shape", default=None, help="C,H,W of a data layer whose shape is unknown.")
@click.option("--workers", default=None,
              help="Worker counts: 1,2,4,8 or 1-16.  [default: 1,2,4,8,16; with "
              "--measured-comm 1 and the traced run's]")
@click.option("--bandwidth", default="10gbit", show_default=True,
              help="Each node's link, each direction: 10gbit, 1gbit, 25GbE...")
@click.option("--latency", default="50us", show_default=True,
              help="Per message hop: 50us, 0.2ms. A layer pays it once per hop of its round: "
              "SFB once, PS twice (push, sum), ring 2(P-1) and hd 2*log2(P) times.")
@click.option("--link", "link_path", type=click.Path(dir_okay=False), default=None,
              help="alpha and beta fitted by `poseidon bench comm --link-out` (replaces "
              "--bandwidth and --latency).")
@click.option("--unfair", type=click.FloatRange(min=0.0), default=None,
              help="How unfairly many TCP flows share one side of a link: the slowest of n "
              "takes 1 + UNFAIR*(1 - 1/n) times its fair share (PS and SFB talk to P-1 peers at "
              "once). [default: the link file's, else 0.25, measured on the emulated cluster; "
              "0: fair]")
@click.option("--scheme", "schemes", default=",".join([*NETWORK_SCHEMES, "hybrid", "auto"]),
              show_default=True,
              help="Schemes to compare.")
@click.option("--slots", type=click.IntRange(min=1), default=1, show_default=True,
              help="Workers per machine: with more than one, the schemes are priced in two "
              "levels (inside a machine first, then across machines); --workers counts workers.")
@click.option("--local-bandwidth", default="40gbit", show_default=True,
              help="With --slots: the link between the workers of one machine.")
@click.option("--chunk-bytes", type=int, default=4 << 20, show_default=True,
              help="The PS chunk size the run will use.")
@click.option("--measured-comm", is_flag=True,
              help="Price each layer's communication by the trace's measured comm_ms (a "
              "trace of a distributed run) instead of the link model: DESIGN.md's DAG "
              "recurrence on measured times, next to the trace's measured iteration.")
@click.option("--save-trace", type=click.Path(dir_okay=False), default=None,
              help="Write the layer times used (e.g. the --estimate) as a trace file.")
@click.option("--json", "as_json", is_flag=True, help="Print the predictions as JSON.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None,
              help="Write speedup against workers as a PNG (needs matplotlib).")
def simulate(model: str, trace_path: str | None, estimate: bool, batch: int | None,
             input_shape: str | None, workers: str | None, bandwidth: str, latency: str,
             link_path: str | None, unfair: float | None, schemes: str, slots: int,
             local_bandwidth: str,
             measured_comm: bool, chunk_bytes: int, save_trace: str | None, as_json: bool,
             plot: str | None) -> None:
    """Predict iteration time, exposed communication and speedup per scheme and worker count."""
    check_plot(plot)
    from engine.comm.link import (
        UNFAIR_MEASURED,
        Link,
        load_link,
        parse_bandwidth,
        parse_duration,
    )
    from engine.perf.dag import MEASURED, SCHEMES, missing_layers, sweep
    from engine.perf.flops import TITAN_X, trace_from_flops
    from engine.perf.netinfo import net_info
    from engine.perf.trace import load_trace

    if (trace_path is None) == (not estimate):
        fail("give --trace FILE or --estimate (not both)")
    if measured_comm and estimate:
        fail("--measured-comm prices the communication a --trace FILE measured, not an --estimate")
    with user_errors():
        counts = parse_workers(workers or "1,2,4,8,16")
        wanted = [s.strip() for s in schemes.split(",") if s.strip()]
        for s in wanted:
            if s not in SCHEMES:
                raise ValueError(f"--scheme {s!r}: choose from {', '.join(SCHEMES)}")
        link = (load_link(link_path) if link_path else
                Link.from_bandwidth(parse_bandwidth(bandwidth), parse_duration(latency),
                                    f"{bandwidth}, {latency} per message",
                                    UNFAIR_MEASURED))
        if unfair is not None:
            link = replace(link, unfair=unfair)
        info = net_info(model, batch, parse_shape(input_shape))
        trace = trace_from_flops(info, TITAN_X) if estimate else load_trace(trace_path)
        if measured_comm:
            if not trace.has_comm:
                raise ValueError(f"{trace_path}: --measured-comm, but its layers carry no "
                                 "comm_ms (models/traces/README.md: a distributed run's trace)")
            wanted = [MEASURED]
            counts = parse_workers(workers) if workers else sorted({1, trace.workers or 1})
            if any(n not in (1, trace.workers) for n in counts):
                raise ValueError(f"--workers {workers}: the trace measured communication with "
                                 f"{trace.workers} workers; --measured-comm predicts 1 and "
                                 f"{trace.workers} only")
        missing = missing_layers(info, trace)
        if missing:
            raise ValueError(f"{trace_path}: no times for layer(s) {', '.join(missing[:5])}"
                             f"{' ...' if len(missing) > 5 else ''} of {model}: a trace of "
                             "another net?")
        if trace.batch is not None and trace.batch != info.batch:
            raise ValueError(f"{trace_path}: traced at batch {trace.batch}, but the net trains "
                             f"with batch {info.batch} (give --batch {trace.batch}?)")
        if save_trace:
            trace.save(save_trace)
        bad = [n for n in counts if n > slots and n % slots]
        if bad:
            raise ValueError(f"--workers {bad[0]} is not a multiple of --slots {slots}")
        local = Link.from_bandwidth(parse_bandwidth(local_bandwidth), 20e-6,
                                    f"inside a machine, {local_bandwidth}")
        predictions = sweep(info, trace, counts, wanted, link, chunk_bytes=chunk_bytes,
                            slots=slots, local_link=local)
        title = (f"{info.name}, batch {info.batch}/worker, " + (
            "communication as measured in the trace" if measured_comm else
            f"{link.bits_per_s / 1e9:g} Gbit/s, alpha {link.alpha_s * 1e6:g} us")
                 + (f", {slots} workers per machine" if slots > 1 else ""))
        plotted = bool(plot) and plot_speedup(
            [Curve(scheme, [p.workers for p in predictions if p.scheme == scheme],
                   [p.speedup for p in predictions if p.scheme == scheme])
             for scheme in dict.fromkeys(p.scheme for p in predictions)],
            plot, title, "speedup (images/s over one worker)")
    report = {"net": info.name, "batch": info.batch, "params": info.total_params,
              "trace": {"source": trace.source, "device": trace.device},
              "link": link.as_dict(), "predictions": [p.summary() for p in predictions]}
    check = _against_measured(predictions, trace) if measured_comm else None
    if check:
        report["measured"] = check
    if as_json:
        click.echo(json.dumps(report, indent=1))
        if plot and not plotted:
            click.echo(f"{NO_MATPLOTLIB}; {plot} was not written", err=True)
        return
    _print_table(predictions, title, trace.source)
    for line in assumptions(trace, link, estimate, measured_comm, slots):
        click.echo(line)
    click.echo(verdict(predictions))
    if check:
        click.echo(f"measured iteration {check['iteration_s'] * 1e3:.2f} ms with "
                   f"{check['workers']} workers; the recurrence on the measured times "
                   f"{check['predicted_s'] * 1e3:.2f} ms ({check['error']:+.2%})")
    if plot:
        click.echo(f"wrote {plot}" if plotted else f"{NO_MATPLOTLIB}; {plot} was not written")


def assumptions(trace: Any, link: Any, estimate: bool, measured_comm: bool,
                slots: int) -> list[str]:
    """What the numbers above rest on, measured or assumed, a line each; a warning first
    where layer times measured on a CPU are to predict what a cluster of GPUs would do."""
    device = trace.device or "a device the trace does not name"
    on_cpu = not estimate and device.lower().startswith("cpu")
    lines = []
    if on_cpu:
        lines.append(f"warning: these layer times were measured on a CPU ({device}): a GPU "
                     "computes 10 to 100 times faster, so on GPUs communication weighs far more "
                     "and the speedups above are too good; time the net on the GPU you will "
                     "rent (`poseidon time --gpu 0 --synthetic --json`) or use --estimate (a "
                     "Titan X from FLOPs)")
    lines.append("assumed: layer times " + (
        "estimated from each layer's FLOPs and bytes on a Titan X" if estimate else
        f"measured on {device} ({trace.source})") + "; every worker as fast, one per GPU"
        + (f", {slots} to a machine" if slots > 1 else ", one per machine"))
    lines.append("assumed: " + ("the communication the trace measured" if measured_comm else
                                f"a link of {link.bits_per_s / 1e9:g} Gbit/s each way and "
                                f"{link.alpha_s * 1e6:g} us per message ({link.source})")
                 + "; the solver update on the GPU at 300 GB/s, sums and SFB's rebuild on "
                 "the host; iteration = compute + exposed (communication and updates not "
                 "hidden behind backward)")
    return lines


def verdict(predictions: Sequence) -> str:
    """One line: the best scheme at each worker count, and where adding workers stops
    paying (efficiency below half)."""
    best: dict[int, Any] = {}
    for p in predictions:
        if p.workers > 1 and (p.workers not in best or p.images_per_s > best[p.workers].images_per_s):
            best[p.workers] = p
    if not best:
        return "verdict: one worker only: nothing to compare"
    picks = ", ".join(f"{n}: {p.scheme} {p.speedup:.2f}x" for n, p in sorted(best.items()))
    poor = [n for n, p in sorted(best.items()) if p.efficiency < 0.5]
    stop = (f"below half efficiency from {poor[0]} workers: scaling stops paying there"
            if poor else "every size keeps at least half its efficiency")
    return f"verdict: best scheme by workers: {picks}; {stop}"


def _against_measured(predictions: Sequence, trace: Any) -> dict[str, float] | None:
    """The traced run's measured iteration next to the recurrence's, when the trace has it."""
    if trace.iteration_ms is None:
        return None
    [p] = [p for p in predictions if p.workers == trace.workers]
    measured = trace.iteration_ms / 1e3
    return {"workers": trace.workers, "iteration_s": measured, "predicted_s": p.iteration_s,
            "error": p.iteration_s / measured - 1.0}


def _print_table(predictions: Sequence, title: str, source: str) -> None:
    cols = ("scheme", "workers", "iteration ms", "compute ms", "exposed ms", "images/s",
            "speedup", "efficiency", "MB/node/iter")
    rows = [(p.scheme, str(p.workers), f"{p.iteration_s * 1e3:.1f}", f"{p.compute_s * 1e3:.1f}",
             f"{p.exposed_comm_s * 1e3:.1f}", f"{p.images_per_s:.1f}", f"{p.speedup:.2f}",
             f"{p.efficiency:.0%}", f"{p.bytes_per_node / 1e6:.1f}") for p in predictions]
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        table = Table(title=title, caption=f"layer times: {source}")
        for c in cols:
            table.add_column(c, justify="left" if c == "scheme" else "right")
        for r in rows:
            table.add_row(*r)
        Console().print(table)
        return
    click.echo(title)
    click.echo(f"layer times: {source}")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    click.echo("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        click.echo("  ".join(v.rjust(w) for v, w in zip(r, widths)))
