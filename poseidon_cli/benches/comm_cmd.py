"""`poseidon bench comm`: the transport's latency and throughput beside a raw TCP stream."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from ..console import fail, user_errors
from ..options import parse_size, parse_sizes, parse_workers



@click.command("comm")
@click.option("--sizes", default=None,
              help="Message sizes: 1K-256M (x4 steps), or a list 4K,64M.  [default: 1K-256M; "
              "with --allreduce 64K,1M,64M]")
@click.option("--repeats", type=int, default=5, show_default=True,
              help="Alternating repetitions per size (fewer for the largest; with --allreduce "
              "at most this many times 4).")
@click.option("--workers", default=None,
              help="Worker counts for the per-scheme table.  [default: 2,4,8,16; with "
              "--allreduce the processes to run: 2,4]")
@click.option("--allreduce", is_flag=True,
              help="Instead: P processes allreduce each size with Poseidon's ring and hd, the "
              "gloo and mpi schemes, and beside them torch.distributed's all_reduce and "
              "mpi4py's Allreduce called bare (MPI when mpi4py and mpiexec are installed).")
@click.option("--bandwidth", default=None,
              help="Through one emulated link of this rate (1gbit, 5gbit; needs root: a "
                   "network namespace at each end, tbf both ways) instead of loopback.")
@click.option("--piece-bytes", default="4M", show_default=True,
              help="Messages larger than this are authenticated and sent in pieces of it.")
@click.option("--gloo/--no-gloo", default=True, show_default=True,
              help="Also run Gloo's point-to-point (torch.distributed, CPU) when PyTorch is "
                   "installed.")
@click.option("--stages", is_flag=True,
              help="Also time where a ping-pong of the smallest size goes, stage by stage.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every row, the fit and the scheme table here.")
@click.option("--link-out", type=click.Path(dir_okay=False), default=None,
              help="Write the fitted alpha and beta for `poseidon simulate --link`.")
def comm(sizes: str | None, repeats: int, workers: str | None, allreduce: bool,
         bandwidth: str | None, piece_bytes: str, gloo: bool, stages: bool,
         json_path: str | None, link_out: str | None) -> None:
    """Poseidon's transport against raw TCP and Gloo between two processes; fits alpha, beta."""
    if allreduce:
        if bandwidth is not None or link_out is not None or stages:
            fail("--allreduce runs on loopback: give it without --bandwidth, --link-out and "
                 "--stages")
        allreduce_table(sizes or "64K,1M,64M", workers or "2,4", repeats, json_path)
        return
    sizes, workers = sizes or "1K-256M", workers or "2,4,8,16"
    from poseidon_cli.benches.comm import cpu_name_and_blas, gloo_available, run, scheme_times
    from poseidon_cli.benches.comm_stages import auth_bytes_per_s, stage_breakdown

    with user_errors():
        chosen = parse_sizes(sizes)
        counts = parse_workers(workers)
        piece = parse_size(piece_bytes)
        if repeats < 1:
            raise ValueError(f"--repeats must be positive, got {repeats}")
        bits = None
        if bandwidth is not None:
            from engine.comm.link import parse_bandwidth
            from engine.perf.netns import check_root, cleanup_stale
            bits = parse_bandwidth(bandwidth)
            check_root("bench comm --bandwidth")
            cleanup_stale()
    why_no_gloo = "--no-gloo" if not gloo else "PyTorch not installed"
    gloo = gloo and gloo_available()
    where = f"one emulated link of {bandwidth} (tbf, network namespaces)" if bits else "loopback"
    peers = "a raw TCP stream" + (", Gloo (torch.distributed send/recv, CPU)" if gloo else
                                  f" (Gloo: {why_no_gloo})")
    click.echo(f"machine: {cpu_name_and_blas()}, {where}; pieces of {piece} bytes; peers in the "
               f"same run: {peers}; iperf3: "
               f"{'installed, not run' if shutil.which('iperf3') else 'not installed'}")
    click.echo(f"{'bytes':>11} {'one-way us':>11} {'poseidon MB/s':>14} {'tcp MB/s':>10} "
               f"{'ratio':>6} {'no-auth MB/s':>13} {'auth cost':>10}"
               + (f" {'gloo one-way us':>16} {'gloo MB/s':>10} {'vs gloo':>8}" if gloo else ""))

    def say(r) -> None:
        line = (f"{r.bytes:>11} {r.poseidon_one_way_s * 1e6:>11.1f} {r.poseidon_mb_s:>14.1f} "
                f"{r.tcp_mb_s:>10.1f} {r.ratio:>6.2f} {r.unauthenticated_mb_s:>13.1f} "
                f"{r.auth_cost:>9.1%}")
        if r.gloo_mb_s is not None:
            line += (f" {r.gloo_one_way_s * 1e6:>16.1f} {r.gloo_mb_s:>10.1f} "
                     f"{r.gloo_ratio:>7.2f}x")
        click.echo(line)

    try:
        rows, link = run(chosen, repeats, say, piece_bytes=piece, bits_per_s=bits, gloo=gloo)
        breakdown = stage_breakdown(min(chosen), piece_bytes=piece) if stages else None
    except (RuntimeError, OSError) as e:
        fail(f"bench comm: {e}")
    click.echo(f"fit: alpha = {link.alpha_s * 1e6:.1f} us, beta = {link.beta_s_per_byte * 1e9:.4f} "
               f"ns/byte ({link.bits_per_s / 1e9:.2f} Gbit/s)")
    auth = auth_bytes_per_s(piece_bytes=piece)
    wire_10g = (64 << 20) / 1.25e9
    click.echo(f"authentication (AES-GMAC, in pieces): {auth / 1e9:.1f} GB/s on one core: a 64 MB "
               f"message costs {(64 << 20) / auth * 1e3:.1f} ms on each side, "
               f"{(64 << 20) / auth / wire_10g:.1%} of its {wire_10g * 1e3:.0f} ms on 10 GbE")
    if breakdown is not None:
        click.echo(f"where a ping-pong of {min(chosen)} bytes goes (loopback, median us; round "
                   f"trip {breakdown['round_trip_us']:.1f} us):")
        for st in breakdown["stages"]:
            us = "-" if st["us"] is None else f"{st['us']:.1f}"
            click.echo(f"  {st['leg']:>5}  {st['stage']:<32} {us:>8}")
    size = max(chosen)
    table = scheme_times(link, size, counts)
    click.echo(f"per-node time to synchronise {size} bytes on this link:")
    for t in table:
        click.echo(f"  P={t['workers']:>3}  ps {t['ps_s'] * 1e3:9.2f} ms   ring {t['ring_s'] * 1e3:9.2f} ms")
    if link_out:
        link.save(link_out)
        click.echo(f"wrote {link_out}")
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"machine": cpu_name_and_blas(), "where": where, "piece_bytes": piece,
             "rows": [r.as_dict() for r in rows], "link": link.as_dict(),
             "auth_bytes_per_s": auth, "stages": breakdown, "schemes": table}, indent=1) + "\n")


def allreduce_table(sizes: str, workers: str, repeats: int, json_path: str | None) -> None:
    """`bench comm --allreduce`: each scheme and each engine called bare, alternating."""
    from poseidon_cli.benches.allreduce import ENGINE_OF, run
    from poseidon_cli.benches.comm import cpu_name_and_blas


    with user_errors():
        chosen = parse_sizes(sizes)
        counts = parse_workers(workers)
        if repeats < 1:
            raise ValueError(f"--repeats must be positive, got {repeats}")
    click.echo(f"machine: {cpu_name_and_blas()}, loopback; allreduce (sum, in place) of float32 "
               "vectors, the time a round from the last rank's start to the last rank's end, "
               "median of alternating repeats (each up to 64 rounds back to back)")
    header: list[str] = []

    def say(row) -> None:
        engines = [s for s in ENGINE_OF if s in row.seconds]
        if not header:
            header.extend(row.seconds)
            click.echo(f"{'P':>3} {'bytes':>10} " + " ".join(f"{p:>22}" for p in header)
                       + " " + " ".join(f"{s + '/bare':>10} {s + ' sum/bare':>14}"
                                        for s in engines))
        click.echo(f"{row.workers:>3} {row.bytes:>10} "
                   + " ".join(f"{row.seconds[p] * 1e6:>19.0f} us" for p in header) + " "
                   + " ".join(f"{row.ratio(s):>9.2f}x {row.ratio(s, ': sum'):>13.2f}x"
                              for s in engines))

    try:
        rows, notes = run(counts, chosen, 4 * repeats, say)
    except (RuntimeError, OSError) as e:
        fail(f"bench comm --allreduce: {e}")
    for engine in ("gloo", "mpi"):
        if engine not in notes["peers"]:
            click.echo(f"{engine}: not run ({notes[engine]})")
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"machine": cpu_name_and_blas(), "where": "loopback", "notes": notes,
             "rows": [r.as_dict() for r in rows]}, indent=1) + "\n")
