"""`--timeline`: Chrome trace events that are valid JSON and nest per thread, for one process
and for a 2-worker run merged into one file."""
from __future__ import annotations

import json
import threading
import time

import pytest

from engine import timeline
from engine.timeline import Timeline, check_nesting, merge
from tests.test_comm_train import digits_db, poseidon, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels


def test_events_nest_per_thread_and_overlaps_are_caught(tmp_path):
    tl = Timeline(tmp_path / "t.json", "test", "p0")
    outer = tl.now()
    inner = tl.now()
    time.sleep(0.002)
    tl.complete("inner", "x", inner)
    tl.complete("outer", "x", outer)

    def other() -> None:  # another thread may overlap freely
        s = tl.now()
        time.sleep(0.002)
        tl.complete("elsewhere", "y", s)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    events = tl.events()
    check_nesting(events)
    assert {e["name"] for e in events if e["ph"] == "M"} == {"process_name", "thread_name"}
    bad = [{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 10},
           {"ph": "X", "name": "b", "pid": 1, "tid": 1, "ts": 5, "dur": 10}]
    with pytest.raises(ValueError, match="b .* overlaps a"):
        check_nesting(bad)
    tl.save_part()
    assert merge(tmp_path / "t.json", expected=1, wait_s=1) == 1
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["displayTimeUnit"] == "ms" and len(doc["traceEvents"]) == len(events)
    assert not (tmp_path / "t.json.parts").exists()
    assert timeline.current is timeline.NOOP  # a Timeline made by hand is not the process's


def xs(doc: dict, cat: str) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == cat]


def test_one_process_records_every_layer_every_iteration(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 8, "one", iters=3)
    out = tmp_path / "trace.json"
    done = poseidon("train", "--solver", str(solver), "--timeline", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    check_nesting(doc["traceEvents"])
    assert len(xs(doc, "iteration")) == 3
    layers = ["data", "conv1", "relu0", "ip1", "relu1", "ip2", "loss"]
    fwd = [e["name"] for e in xs(doc, "forward")]
    assert all(fwd.count(l) >= 3 for l in layers)
    bwd = {e["name"] for e in xs(doc, "backward")}
    assert {"conv1", "ip1", "ip2", "loss"} <= bwd and "data" not in bwd


def test_two_workers_merge_into_one_file(digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 8, "two", iters=3)
    hosts, _ = write_hosts(tmp_path, 2)
    out = tmp_path / "trace.json"
    done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--comm", "hybrid",
                    "--timeline", str(out), "--timeout", "20")
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    check_nesting(doc["traceEvents"])
    assert sorted(doc["metadata"]["parts"]) == ["shard0", "shard1", "worker0", "worker1"]
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"worker 0", "worker 1", "shard 0", "shard 1"}
    sends = {(e["pid"], e["name"]) for e in xs(doc, "send") if not e["name"].startswith("send sum")}
    workers = {e["pid"] for e in doc["traceEvents"] if e.get("args", {}).get("name", "").startswith("worker")}
    assert {name for _, name in sends} >= {"send conv1", "send ip1", "send ip2"}
    assert {pid for pid, _ in sends} == workers
    assert xs(doc, "aggregate") and xs(doc, "update") and xs(doc, "rebuild")  # ip1 by SFB
    assert not (tmp_path / "trace.json.parts").exists()
