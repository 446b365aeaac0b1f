"""`poseidon convert`: move weights between .caffemodel, .caffemodel.h5 and .npz, upgrade old
(V0/V1) prototxts and caffemodels to the current dialect, and `--info` to describe a file.

Caffe's upgrade_net_proto_text / upgrade_net_proto_binary in one command: a binary caffemodel
converted to a binary caffemodel keeps its full layer definitions, only upgraded.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
import numpy as np
from google.protobuf import text_format

from engine import caffe_io
from engine.caffe_io import FormatError
from engine.pb import caffe_pb2
from poseidon_cli.console import fail

TEXT_SUFFIXES = (".prototxt", ".pbtxt", ".txt")
#: what OUT may be named: a prototxt, or weights in the format caffe_io.format_by_name reads
#: from the name (anything else would be written as a binary caffemodel under a name that
#: says otherwise: .pt, .pkl, no suffix)
OUT_SUFFIXES = (*TEXT_SUFFIXES, ".caffemodel", ".h5", ".hdf5", ".npz")


def _is_text(path: str) -> bool:
    return path.lower().endswith(TEXT_SUFFIXES)


def _read_text_proto(path: str) -> caffe_pb2.NetParameter | caffe_pb2.SolverParameter:
    """A net prototxt, or a solver prototxt when it does not read as a net."""
    try:
        return caffe_io.read_net_prototxt(path)
    except FormatError as net_error:
        try:
            return caffe_io.read_solver_prototxt(path)
        except FormatError:
            raise net_error from None


def _convert(src: str, dst: str) -> str:
    if not dst.lower().endswith(OUT_SUFFIXES):
        raise FormatError(f"{dst}: unknown output format {Path(dst).suffix or '(no suffix)'}: "
                          "name OUT *.caffemodel, *.caffemodel.h5 (or .h5, .hdf5), *.npz or "
                          "*.prototxt (or .pbtxt, .txt)")
    if _is_text(src) != _is_text(dst):
        raise FormatError(f"cannot convert between a prototxt and a weights file: {src} -> {dst}")
    if _is_text(src):
        msg = _read_text_proto(src)
        caffe_io.write_prototxt(dst, msg)
        return f"wrote {dst} ({type(msg).__name__}, current format)"
    if caffe_io.weights_format(src) == "binary" and caffe_io.format_by_name(dst) == "binary":
        net = caffe_io.read_net_binary(src)  # upgraded, layer definitions kept
        caffe_io.write_net_binary(dst, net)
        return f"wrote {dst} ({len(net.layer)} layers, current format)"
    weights = caffe_io.read_weights(src)
    caffe_io.write_weights(dst, weights, name=Path(src).name.split(".")[0])
    n_params = sum(int(a.size) for _, _, arrays in weights for a in arrays)
    return f"wrote {dst} ({len(weights)} layers, {n_params:,} parameters)"


def _info_rows(path: str) -> tuple[list[str], list[list[str]], str]:
    """Column names, rows and a summary line describing `path`."""
    if _is_text(path):
        msg = _read_text_proto(path)
        if isinstance(msg, caffe_pb2.SolverParameter):
            # Text format prints enums by name and floats at their shortest (0.001, not 0.00100..).
            rows = [line.split(": ", 1) for line in
                    text_format.MessageToString(msg, as_one_line=False).splitlines()
                    if ": " in line and not line.startswith(" ")]
            return ["field", "value"], rows, f"{path}: solver, type {msg.type}"
        rows = [[l.name, l.type, ", ".join(l.bottom), ", ".join(l.top)] for l in msg.layer]
        return (["layer", "type", "bottom", "top"], rows,
                f"{path}: net '{msg.name}', {len(msg.layer)} layers")
    if path.lower().endswith(".binaryproto"):  # a mean image, or any one blob
        a = caffe_io.read_blobproto(path)
        shape = "x".join(str(d) for d in a.shape) or "scalar"
        rows = [["shape", shape], ["count", f"{a.size:,}"]]
        if a.size:
            rows += [[k, f"{f(a):.6g}"] for k, f in (("min", np.min), ("max", np.max),
                                                     ("mean", np.mean))]
        if a.ndim == 4:  # N x C x H x W: the per-channel means a Caffe user sets as mean_value
            means = ", ".join(f"{m:.4g}" for m in a.mean(axis=(0, 2, 3)))
            rows.append(["channel means", means])
        return ["field", "value"], rows, f"{path}: blob {shape}"
    if ".solverstate" in Path(path).name.lower():
        return _solverstate_rows(path)
    if caffe_io.weights_format(path) == "binary":
        weights = caffe_io.net_to_weights(caffe_io.read_net_binary(path), path)
    else:
        weights = caffe_io.read_weights(path)
    rows, total = [], 0
    for name, layer_type, arrays in weights:
        count = sum(int(a.size) for a in arrays)
        total += count
        shapes = ", ".join("x".join(str(d) for d in a.shape) or "scalar" for a in arrays)
        rows.append([name, layer_type or "-", shapes or "-", f"{count:,}"])
    untyped = " (Caffe's HDF5 stores no layer types)" if all(not t for _, t, _ in weights) \
        and caffe_io.weights_format(path) == "hdf5" else ""
    return (["layer", "type", "parameter shapes", "count"], rows,
            f"{path}: {len(weights)} layers, {total:,} parameters{untyped}")


def _solverstate_rows(path: str) -> tuple[list[str], list[list[str]], str]:
    """A solverstate: its iteration, history, weights file, data positions and recorded plan."""
    from engine.comm.plan_file import recorded_plan

    state = caffe_io.read_solverstate(path)
    history = caffe_io.solverstate_history(state)
    try:
        weights = f"{state.learned_net} (found: {caffe_io.resolve_learned_net(path, state)})"
    except FormatError:
        weights = f"{state.learned_net} (not found beside {path} nor as written)"
    positions = (", ".join(str(p) for p in state.data_position) + " records read, per data "
                 "layer" if len(state.data_position) else "not recorded (a Caffe snapshot: a "
                 "resumed run reads from where Caffe's uninterrupted run would be)")
    rows = [["iteration", str(state.iter)], ["current_step", str(state.current_step)],
            ["learned_net", weights],
            ["history", f"{len(history)} blobs, {sum(int(a.size) for a in history):,} values"],
            ["data positions", positions]]
    plan = recorded_plan(path)
    if plan is None:
        rows.append(["plan", "none (a single process's or Caffe's snapshot)"])
    else:
        machines = f", {plan.world_size // plan.slots} machines of {plan.slots}" \
            if plan.slots > 1 else ""
        rows += [["plan workers", f"{plan.world_size}{machines}"],
                 ["plan comm", f"{plan.comm or 'auto'}, wire {plan.codec or 'fp32'}"],
                 ["plan units", "; ".join(f"{'+'.join(u.names)} {u.scheme}" for u in plan.units)]]
    return ["field", "value"], rows, f"{path}: solverstate at iteration {state.iter}"


def _print_table(columns: list[str], rows: list[list[str]], summary: str) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table()
        for c in columns:
            table.add_column(c, justify="right" if c == "count" else "left")
        for r in rows:
            table.add_row(*r)
        console = Console()
        console.print(summary, highlight=False)
        console.print(table)
        return
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    click.echo(summary)
    click.echo("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())


@click.command("convert")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("dst", metavar="OUT", required=False, type=click.Path(dir_okay=False))
@click.option("--info", is_flag=True, help="Describe IN (layers, parameter shapes and counts).")
def convert(src: str, dst: str | None, info: bool) -> None:
    """Convert IN to OUT by their suffixes: .caffemodel, .caffemodel.h5, .npz (arrays named
    <layer>/<i>), or upgrade a V0/V1 .prototxt / .caffemodel to the current format."""
    try:
        if info:
            if dst is not None:
                fail("--info takes one file, not IN and OUT")
            _print_table(*_info_rows(src))
            return
        if dst is None:
            fail("missing OUT (or use --info IN)")
        click.echo(_convert(src, dst))
    except FormatError as e:
        fail(str(e))
    except BrokenPipeError:
        raise  # the reader stopped reading (`| head`): click ends quietly
    except OSError as e:
        fail(f"{e.filename or dst}: {e.strerror or e}")
