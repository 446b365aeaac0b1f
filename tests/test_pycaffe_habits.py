"""What a pycaffe script of many years does and expects: ``caffe.proto.caffe_pb2`` after a bare
``import caffe``, ``GLOG_minloglevel=2`` to keep Nets and Solvers quiet, and an LMDB the script
opened itself named with what to do. Each runs in a fresh interpreter, as a script does."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LENET = ROOT / "models" / "lenet" / "deploy.prototxt"


def script(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_caffe_proto_caffe_pb2_after_a_bare_import_caffe():
    done = script("import caffe\nprint(caffe.proto.caffe_pb2.NetParameter.DESCRIPTOR.full_name)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "caffe.NetParameter"


def test_glog_minloglevel_2_keeps_a_solver_quiet(tmp_path):
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{LENET}"\nbase_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 1\n')
    code = f"import caffe\ns = caffe.SGDSolver({str(solver)!r})\nprint(len(s.net.layers))"
    loud = script(code)
    quiet = script(code, GLOG_minloglevel="2")
    assert loud.returncode == quiet.returncode == 0, quiet.stderr[-2000:]
    assert "Initializing solver from parameters" in loud.stderr
    assert quiet.stderr == "" and quiet.stdout == loud.stdout


def test_an_lmdb_the_script_opened_itself_is_named_with_what_to_do(tmp_path):
    from engine.data.converters import convert_digits
    convert_digits(tmp_path)
    db = tmp_path / "digits_train_lmdb"
    net = tmp_path / "net.prototxt"
    net.write_text(f'layer {{ name: "d" type: "Data" top: "data" top: "label"\n'
                   f'  data_param {{ source: "{db}" backend: LMDB batch_size: 4 }} }}\n')
    done = script(f"import lmdb\nenv = lmdb.open({str(db)!r}, readonly=True, lock=False)\n"
                  f"import caffe\ncaffe.Net({str(net)!r}, caffe.TRAIN)")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "already open in this process" in last
    assert "close that environment (env.close()) before building the net" in last
