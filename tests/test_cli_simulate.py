"""`poseidon simulate` on the command line: JSON, a measured trace, bad input, --plot."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tests.test_cli_caffe_habits import run

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = pytest.mark.slow

S4 = "models/vgg19_22k_s4/train_val.prototxt"


def test_json_predictions_for_every_scheme_and_count():
    done = run("simulate", "--model", S4, "--estimate", "--workers", "1,2,4-5", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {(p["scheme"], p["workers"]): p for p in report["predictions"]}
    assert set(rows) == {(s, n) for s in ("ps", "sfb", "ring", "hd", "hybrid", "auto")
                         for n in (1, 2, 4, 5)}
    assert report["params"] == 14_322_532 and report["batch"] == 32
    assert report["link"]["bandwidth_bits_per_s"] == pytest.approx(1e10)
    assert rows[("hybrid", 4)]["speedup"] > rows[("ps", 4)]["speedup"]
    # the planner's pick per layer is never slower than a single scheme for the whole net
    for n in (2, 4, 5):
        best = max(rows[(s, n)]["speedup"] for s in ("ps", "sfb", "ring", "hd", "hybrid"))
        assert rows[("auto", n)]["speedup"] >= 0.97 * best, n


def test_a_poseidon_time_report_is_a_trace(tmp_path):
    net = "models/digits_lenet/deploy.prototxt"  # an Input layer: no LMDB needed
    timed = run("time", "--model", net, "--iterations", "2", "--json")
    assert timed.returncode == 0, timed.stderr
    (tmp_path / "t.json").write_text(timed.stdout)
    done = run("simulate", "--model", net, "--trace", str(tmp_path / "t.json"), "--workers", "1,2",
               "--bandwidth", "1gbit", "--latency", "0.1ms", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    compute = json.loads(timed.stdout)["forward_backward_ms"] / 1e3
    one = next(p for p in report["predictions"] if p["workers"] == 1)
    assert one["compute_s"] == pytest.approx(compute, rel=1e-9)


@pytest.mark.parametrize("args, needle", [
    (["--trace", "missing.json"], "trace file missing.json not found"),
    (["--estimate", "--workers", "0,2"], "--workers '0,2'"),
    (["--estimate", "--bandwidth", "fast"], "bandwidth 'fast'"),
    (["--estimate", "--scheme", "allgather"], "--scheme 'allgather'"),
    ([], "give --trace FILE or --estimate"),
])
def test_bad_input_is_one_line(args, needle):
    done = run("simulate", "--model", S4, *args)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("poseidon: error:") and needle in lines[0], lines


def test_a_train_net_timed_on_synthetic_inputs_is_a_trace_with_its_batch(tmp_path):
    """`time --synthetic` times a train_val net without its LMDB (crop_size gives the shape):
    the report is a poseidon-layer-trace with the batch asked for, loss backward included."""
    net = "models/digits_lenet/train_val.prototxt"
    timed = run("time", "--model", net, "--synthetic", "--batch", "4", "--iterations", "2",
                "--json")
    assert timed.returncode == 0, timed.stderr
    trace = json.loads(timed.stdout)
    assert trace["format"] == "poseidon-layer-trace" and trace["batch"] == 4
    assert trace["device"].startswith("CPU") and "2 iterations" in trace["source"]
    layers = {l["name"]: l for l in trace["layers"]}
    assert layers["loss"]["backward_ms"] > 0 and layers["ip1"]["backward_ms"] > 0
    (tmp_path / "t.json").write_text(timed.stdout)
    done = run("simulate", "--model", net, "--trace", str(tmp_path / "t.json"), "--batch", "4",
               "--workers", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batch"] == 4
    wrong = run("simulate", "--model", net, "--trace", str(tmp_path / "t.json"), "--workers", "2")
    assert wrong.returncode == 1 and "traced at batch 4" in wrong.stderr


@pytest.mark.parametrize("args, needle", [
    (["--batch", "4"], "add --synthetic"),
    (["--synthetic", "--batch", "0"], "--batch must be positive"),
    (["--synthetic", "--phase", "TEST"], "drop --phase TEST"),
])
def test_time_synthetic_bad_input_is_one_line(args, needle):
    done = run("time", "--model", "models/digits_lenet/train_val.prototxt", *args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and needle in lines[0], lines


def test_a_trace_of_another_net_is_named(tmp_path):
    lenet = run("time", "--model", "models/digits_lenet/deploy.prototxt", "--iterations", "1",
                "--json")
    (tmp_path / "t.json").write_text(lenet.stdout)
    done = run("simulate", "--model", S4, "--trace", str(tmp_path / "t.json"))
    assert done.returncode == 1 and "a trace of another net?" in done.stderr


def test_plot(tmp_path):
    png = tmp_path / "speedup.png"
    done = run("simulate", "--model", S4, "--estimate", "--workers", "1,2,4", "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        # refused before any work, in one line naming the checkout's extra (not PyPI's
        # `poseidon`, which is another project)
        from poseidon_cli.options import NO_MATPLOTLIB
        assert done.returncode == 1 and not png.exists() and done.stdout == ""
        assert done.stderr.strip() == f"poseidon: error: {NO_MATPLOTLIB}"
    else:
        assert done.returncode == 0, done.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slots_price_two_levels():
    """2 machines of 4 workers at 1 Gbit/s: reducing inside each machine first moves one copy
    of the gradients per machine, so PS over 8 workers is predicted well above (1.46x) the flat
    figure of every worker a machine of its own with a link of its own (tests/test_comm_levels*.py
    check the real runs)."""
    common = ["simulate", "--model", S4, "--estimate", "--workers", "8", "--scheme", "ps",
              "--bandwidth", "1gbit", "--json"]
    two = run(*common, "--slots", "4")
    flat = run(*common)
    assert two.returncode == 0 and flat.returncode == 0, (two.stderr, flat.stderr)
    [p2] = [p for p in json.loads(two.stdout)["predictions"] if p["workers"] == 8]
    [p1] = [p for p in json.loads(flat.stdout)["predictions"] if p["workers"] == 8]
    assert p2["speedup"] > 1.3 * p1["speedup"], (p2, p1)
    bad = run("simulate", "--model", S4, "--estimate", "--workers", "6", "--slots", "4")
    assert bad.returncode == 1 and "not a multiple of --slots 4" in bad.stderr


def test_measured_communication_from_a_trace(tmp_path):
    """A distributed run's trace with comm_ms per layer and its measured iteration: simulate
    --measured-comm prices the layers by those times, prints the measured iteration beside the
    recurrence's, and refuses what it cannot use with one line."""
    net = "models/digits_lenet/deploy.prototxt"
    timed = run("time", "--model", net, "--iterations", "1", "--json")
    trace = json.loads(timed.stdout)
    trace.update(format="poseidon-layer-trace", version=1, batch=1, workers=4,
                 iteration_ms=1000.0)
    for layer in trace["layers"]:
        layer.update(forward_ms=0.0, backward_ms=10.0)
        if layer["type"] in ("Convolution", "InnerProduct"):
            layer["comm_ms"] = 100.0
    path = tmp_path / "run.json"
    path.write_text(json.dumps(trace))
    n_comm = sum("comm_ms" in l for l in trace["layers"])
    done = run("simulate", "--model", net, "--trace", str(path), "--measured-comm", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [four] = [p for p in report["predictions"] if p["workers"] == 4]
    # backward (10 ms a layer) releases ip2 at 20 ms, behind prob; from then on the layers with
    # parameters hold the network 100 ms each in turn (each is released before the one
    # before it is done), the last one ending 20 + 100 n ms after backward began; the next
    # iteration's forward (0 ms) waits for it
    assert n_comm == 4
    want = (20 + 100 * n_comm) / 1e3
    assert four["scheme"] == "measured" and four["iteration_s"] == pytest.approx(want)
    assert report["measured"]["error"] == pytest.approx(want / 1.0 - 1)
    text = run("simulate", "--model", net, "--trace", str(path), "--measured-comm")
    assert f"the recurrence on the measured times {want * 1e3:.2f} ms" in text.stdout
    del trace["workers"]
    path.write_text(json.dumps(trace))
    bad = run("simulate", "--model", net, "--trace", str(path), "--measured-comm")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 1 and len(lines) == 1 and "'workers' must say how many" in lines[0]


def test_bench_clusters_curves_start_at_one_worker_and_pair_measured_with_predicted():
    from types import SimpleNamespace as Row

    from poseidon_cli.benches.cluster_cmd import _curves
    rows = [Row(workers=1, scheme="-", speedup=1.0, predicted_speedup=1.0),
            Row(workers=2, scheme="ps", speedup=1.8, predicted_speedup=1.9),
            Row(workers=2, scheme="ring", speedup=1.7, predicted_speedup=1.75),
            Row(workers=4, scheme="ps", speedup=3.1, predicted_speedup=3.3)]
    ps, ring = _curves(rows)
    assert (ps.label, list(ps.workers), list(ps.speedup), list(ps.predicted)) == (
        "ps", [1, 2, 4], [1.0, 1.8, 3.1], [1.0, 1.9, 3.3])
    assert (ring.label, list(ring.workers), list(ring.predicted)) == ("ring", [1, 2], [1.0, 1.75])


def test_a_cpu_trace_is_flagged_and_the_table_states_its_assumptions_and_a_verdict(tmp_path):
    """Layer times measured on a CPU predict a GPU cluster too well: said first; then what was
    assumed, and one line naming the best scheme per size and where scaling stops."""
    net = "models/digits_lenet/deploy.prototxt"  # an Input layer: no LMDB needed
    timed = run("time", "--model", net, "--iterations", "2", "--json")
    assert timed.returncode == 0, timed.stderr
    assert json.loads(timed.stdout)["device"].startswith("CPU")
    (tmp_path / "t.json").write_text(timed.stdout)
    done = run("simulate", "--model", net, "--trace", str(tmp_path / "t.json"), "--workers",
               "1,2,8", "--scheme", "ps,hybrid")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    [warning] = [l for l in lines if l.startswith("warning:")]
    assert "measured on a CPU" in warning and "--gpu 0" in warning
    assert sum(l.startswith("assumed:") for l in lines) == 2
    assert lines[-1].startswith("verdict: best scheme by workers: 2: ")
    # the columns add up: iteration = compute + exposed, one worker included
    header = next(i for i, l in enumerate(lines) if l.strip().startswith("scheme"))
    for row in lines[header + 1:header + 7]:
        cells = row.split()
        iteration, compute, exposed = (float(c) for c in cells[2:5])
        assert iteration == pytest.approx(compute + exposed, abs=0.11), row


def test_an_estimate_is_no_cpu_trace():
    done = run("simulate", "--model", S4, "--estimate", "--workers", "1,2")
    assert done.returncode == 0, done.stderr
    assert "warning:" not in done.stdout and "estimated from each layer's FLOPs" in done.stdout
