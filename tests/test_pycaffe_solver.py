"""pycaffe's solver API (``caffe.SGDSolver(file)`` ... ``caffe.get_solver``): the class decides
the update rule, paths resolve from the working directory, step/solve/snapshot/restore, the
two-function callbacks, and each rule's first update against Caffe's formulas."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import caffe

NET = """name: "tiny"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 }
    data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "y" top: "loss" }
"""

LR, MOMENTUM, RMS_DECAY, BETA2, DELTA = 0.1, 0.9, 0.8, 0.999, 1e-8


def write_solver(folder: Path, extra: str = "", momentum: float = MOMENTUM) -> Path:
    """A solver in ``folder/sub`` whose net path, ``net.prototxt``, is relative to the cwd."""
    (folder / "net.prototxt").write_text(NET)
    (folder / "sub").mkdir(exist_ok=True)
    path = folder / "sub" / "solver.prototxt"
    path.write_text(f"""net: "net.prototxt" base_lr: {LR} lr_policy: "fixed" momentum: {momentum}
        rms_decay: {RMS_DECAY} momentum2: {BETA2} delta: {DELTA} max_iter: 6 display: 0
        random_seed: 5 snapshot_prefix: "snaps/tiny" {extra}""")
    (folder / "snaps").mkdir(exist_ok=True)
    return path


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def first_update(rule: str, g: np.ndarray) -> np.ndarray:
    """Caffe's update value on the first iteration (zero histories) for gradient g."""
    m = MOMENTUM
    return {
        "SGD": LR * g,
        "Nesterov": (1 + m) * LR * g,
        "AdaGrad": LR * g / (np.abs(g) + DELTA),
        "RMSProp": LR * g / (np.sqrt((1 - RMS_DECAY) * g * g) + DELTA),
        "AdaDelta": LR * g * np.sqrt(DELTA / ((1 - m) * g * g + DELTA)),
        "Adam": LR * np.sqrt(1 - BETA2) / (1 - m) * (1 - m) * g
        / (np.sqrt((1 - BETA2) * g * g) + DELTA),
    }[rule]


@pytest.mark.parametrize("cls", [caffe.SGDSolver, caffe.NesterovSolver, caffe.AdaGradSolver,
                                 caffe.RMSPropSolver, caffe.AdaDeltaSolver, caffe.AdamSolver])
def test_each_class_applies_its_own_rule(cls, in_tmp):
    # the file says SGD (by default): the class wins, as Caffe's typed constructors do
    no_momentum = cls in (caffe.AdaGradSolver, caffe.RMSPropSolver)
    solver = cls(str(write_solver(in_tmp, momentum=0 if no_momentum else MOMENTUM)))
    assert solver.type == cls.update_rule
    w = solver.net.params["ip"][0]
    g = np.linspace(-2, 3, w.count, dtype=np.float32).reshape(w.shape)
    w.data[...] = 0
    w.diff[...] = g
    solver.apply_update()  # computes the iteration's rate itself
    np.testing.assert_allclose(w.data, -first_update(cls.update_rule, g.astype(np.float64)),
                               rtol=1e-5, atol=1e-9)


def test_get_solver_follows_the_files_type_and_paths_start_at_the_cwd(in_tmp):
    solver = caffe.get_solver(str(write_solver(in_tmp, 'type: "Adam"')))
    assert isinstance(solver, caffe.AdamSolver)
    assert isinstance(solver.net, caffe.Net) and solver.net.outputs == ["loss"]
    assert solver.lr == pytest.approx(LR)
    paths = solver.snapshot()
    assert paths is not None and all(p.resolve().parent == in_tmp / "snaps" for p in paths)
    assert {p.name for p in (in_tmp / "snaps").iterdir()} == {"tiny_iter_0.caffemodel",
                                                              "tiny_iter_0.solverstate"}


def test_step_solve_callbacks_snapshot_and_exact_restore(in_tmp):
    path = write_solver(in_tmp, "test_iter: 2 test_interval: 3")
    solver = caffe.SGDSolver(str(path))
    assert len(solver.test_nets) == 1 and solver.iter == 0
    events: list[str] = []
    solver.add_callback(lambda: events.append("start"), lambda: events.append("ready"))
    solver.step(2)
    assert solver.iter == 2 and events == ["start", "ready"] * 2
    solver.snapshot()
    solver.step(3)
    want = solver.net.params["ip"][0].data.copy()

    again = caffe.SGDSolver(str(path))
    again.restore(str(in_tmp / "snaps" / "tiny_iter_2.solverstate"))
    assert again.iter == 2
    again.step(3)
    np.testing.assert_array_equal(again.net.params["ip"][0].data, want)
    again.solve()
    assert again.iter == 6

    # a test net sees the train net's weights without a copy
    test_net = again.test_nets[0]
    again.share_weights(test_net)
    assert test_net.params["ip"][0] is again.net.params["ip"][0]


def test_a_solver_the_engine_refuses_says_why(in_tmp):
    with pytest.raises(ValueError, match="momentum cannot be used with AdaGrad"):
        caffe.AdaGradSolver(str(write_solver(in_tmp)))
