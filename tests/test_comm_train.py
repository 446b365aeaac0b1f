"""`poseidon train --hosts` end to end: P local workers with batch B equal one worker with P·B.

Real processes over loopback, on the 8x8 digits LMDB (made offline from scikit-learn's copy):
a small conv + two InnerProduct net, SGD with momentum and weight decay, 20 iterations.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from engine.caffe_io import blob_to_array, read_net_binary
from engine.pb import poseidon_pb2 as pb
from tests.test_comm_transport import free_base_port

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BATCH = 32

NET = """name: "CommNet"
layer {{ name: "data" type: "Data" top: "data" top: "label"
  transform_param {{ scale: 0.00390625 }}
  data_param {{ source: "{db}" backend: LMDB batch_size: {batch} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 8 kernel_size: 3 pad: 1 weight_filler {{ type: "xavier" }}
                       bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu0" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
  inner_product_param {{ num_output: 256 weight_filler {{ type: "xavier" }}
                         bias_filler {{ type: "constant" value: 0.1 }} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
  inner_product_param {{ num_output: 10 weight_filler {{ type: "xavier" }} bias_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }}
"""

SOLVER = """net: "{net}"
type: "SGD"
base_lr: 0.05
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
max_iter: {iters}
display: {display}
random_seed: 1
snapshot_after_train: true
snapshot_prefix: "{prefix}"
"""


@pytest.fixture(scope="module")
def digits_db(tmp_path_factory) -> Path:
    from engine.data.converters import convert_digits
    out = tmp_path_factory.mktemp("digits")
    convert_digits(out)
    return out / "digits_train_lmdb"


def write_run(d: Path, db: Path, batch: int, name: str, iters: int = 20, display: int = 0) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}_net.prototxt").write_text(NET.format(db=db, batch=batch))
    solver = d / f"{name}_solver.prototxt"
    solver.write_text(SOLVER.format(net=f"{name}_net.prototxt", iters=iters, display=display,
                                    prefix=d / name))
    return solver


def write_hosts(d: Path, n: int) -> tuple[Path, int]:
    base = free_base_port(n)
    path = d / f"hosts{n}"
    path.write_text("".join(f"{i} 127.0.0.1 {base + 2 * i}\n" for i in range(n)))
    return path, base


def poseidon(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poseidon_cli.main", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def weights(path: Path) -> dict[str, np.ndarray]:
    net = read_net_binary(path)
    return {f"{l.name}/{j}": blob_to_array(b) for l in net.layer for j, b in enumerate(l.blobs)}


@pytest.fixture(scope="module")
def reference(digits_db, tmp_path_factory) -> dict[str, np.ndarray]:
    d = tmp_path_factory.mktemp("ref")
    done = poseidon("train", "--solver", str(write_run(d, digits_db, TOTAL_BATCH, "ref")))
    assert done.returncode == 0, done.stderr[-2000:]
    return weights(d / "ref_iter_20.caffemodel")


def forge_forever(port: int, stop: threading.Event) -> int:
    """Send bad messages to a worker's port until told to stop; returns how many."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    wrong_shape = pb.Header(kind=pb.FACTORS, sender_role=pb.WORKER, sender=1, layer=3)
    wrong_shape.arrays.add(dtype="<f4", shape=[2, 2])
    unknown_layer = pb.Header(kind=pb.SUM, sender_role=pb.SHARD, sender=1, param=99)
    unknown_layer.arrays.add(dtype="<f4", shape=[4])
    sent = 0
    while not stop.is_set():
        sock.send_multipart([b"\x00garbage\xff" * 3])
        sock.send_multipart([wrong_shape.SerializeToString(), np.ones(4, np.float32).tobytes()])
        sock.send_multipart([unknown_layer.SerializeToString(), np.ones(4, np.float32).tobytes()])
        sent += 3
        time.sleep(0.01)
    sock.close()
    return sent


def check_p_workers_equal_one_worker(world: int, comm: str, db: Path,
                                     reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    """Train with ``world`` local workers; compare with the reference and check the counters."""
    solver = write_run(tmp_path, db, TOTAL_BATCH // world, "dist")
    hosts, base = write_hosts(tmp_path, world)
    stats = tmp_path / "stats.json"
    stop = threading.Event()
    forger = threading.Thread(target=forge_forever, args=(base, stop), daemon=True)
    if comm == "hybrid":  # forged messages hitting worker 0 during training change nothing
        forger.start()
    try:
        done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts), "--comm", comm,
                        "--timeout", "20", "--stats", str(stats))
    finally:
        stop.set()
    assert done.returncode == 0, done.stderr[-3000:]
    got = weights(tmp_path / "dist_iter_20.caffemodel")
    assert got.keys() == reference.keys()
    for name, want in reference.items():
        rel = np.linalg.norm(got[name] - want) / np.linalg.norm(want)
        assert rel <= 1e-5, (name, rel)
    s = json.loads(stats.read_text())
    assert s["replicas_identical"] is True and s["world_size"] == world
    schemes = {row["layer"]: row["scheme"] for row in s["plan"]}
    want_fc = {"ps": "ps", "sfb": "sfb", "hybrid": "sfb"}[comm]
    assert schemes["conv1"] == "ps" and schemes["ip1"] == want_fc
    if comm == "hybrid":
        assert schemes["ip2"] == "ps"  # 10 outputs: the factors cost more than the matrix
        assert "Communication plan: %d workers" % world in done.stderr
    # SFB counters: K=TOTAL_BATCH/P rows, M=512 inputs, N=256 outputs, floats sent+received
    if schemes["ip1"] == "sfb":
        ip1 = next(r for r in s["layers"] if r["name"] == "ip1")
        k = TOTAL_BATCH // world
        assert ip1["net_sent_per_iter"] + ip1["net_recv_per_iter"] == 4 * 2 * k * (world - 1) * (512 + 256)


@pytest.mark.parametrize("comm", ["ps", "sfb", "hybrid"])
def test_two_workers_equal_one_worker_with_twice_the_batch(comm, digits_db, reference, tmp_path):
    check_p_workers_equal_one_worker(2, comm, digits_db, reference, tmp_path)
