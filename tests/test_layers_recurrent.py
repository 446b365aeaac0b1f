"""Recurrent layers (engine/layers/recurrent.py): RNN, LSTM and LSTMUnit built from prototxt,
values against hand computations of Caffe's formulas, the cont reset and the state carried
between batches, float64 gradient checks, and Caffe's recurrent example flow: an LSTM net
trained by the Solver on a toy sequence task."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.blob import Blob
from engine.caffe_io import array_to_blob, copy_weights_into, parse_net_text
from engine.layers import LayerError
from engine.net import Net
from engine.pb import caffe_pb2
from engine.solver import Solver
from tests.gradcheck import blob_of, check_layer_gradients, make_layer as make

FILLERS = ("weight_filler{type:'uniform' min:-0.5 max:0.5} "
           "bias_filler{type:'uniform' min:-0.5 max:0.5}")
#: recurrent states each type exposes with expose_hidden, in Caffe's order
STATES = {"LSTM": ("h", "c"), "RNN": ("h",)}


def spec(kind: str, hidden: int, expose: bool = False) -> str:
    return (f"name:'rec' type:'{kind}' recurrent_param{{num_output:{hidden} "
            f"expose_hidden:{str(expose).lower()} {FILLERS}}}")


def tops(n: int, dtype=np.float64) -> list[Blob]:
    return [Blob((), dtype=dtype) for _ in range(n)]


def sig(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def unit_by_hand(c_prev: np.ndarray, gates: np.ndarray,
                 cont: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Caffe's LSTMUnit formulas, written out: (c, h)."""
    hd = c_prev.shape[-1]
    i, f = sig(gates[..., :hd]), cont[..., None] * sig(gates[..., hd:2 * hd])
    o, g = sig(gates[..., 2 * hd:3 * hd]), np.tanh(gates[..., 3 * hd:])
    c = f * c_prev + i * g
    return c, o * np.tanh(c)


def recurrent_inputs(kind: str, steps: int, streams: int, hidden: int, static: bool,
                     expose: bool, seed: int = 0) -> list[Blob]:
    """x (T, N, 3, 1), cont, [x_static (N, 2)], [initial states]; cont starts each stream at
    0 unless the states are exposed, so a state carried from an earlier pass cannot matter."""
    rng = np.random.default_rng(seed)
    cont = np.ones((steps, streams))
    if not expose:
        cont[0] = 0
    cont[steps // 2, 0] = 0  # one stream starts a new sequence mid-batch
    bottom = [blob_of(rng.standard_normal((steps, streams, 3, 1))), blob_of(cont)]
    if static:
        bottom.append(blob_of(rng.standard_normal((streams, 2))))
    if expose:
        bottom += [blob_of(rng.standard_normal((1, streams, hidden))) for _ in STATES[kind]]
    return bottom


# -- (1) building from prototxt ------------------------------------------------------------
@pytest.mark.parametrize("kind, static, shapes", [
    ("LSTM", False, [(12, 5), (12,), (12, 3)]),
    ("LSTM", True, [(12, 5), (12,), (12, 4), (12, 3)]),
    ("RNN", False, [(3, 5), (3,), (3, 3), (3, 3), (3,)]),
    ("RNN", True, [(3, 5), (3,), (3, 4), (3, 3), (3, 3), (3,)]),
])
def test_parameter_blobs_in_caffes_order_and_shapes(kind, static, shapes) -> None:
    # x is (T, N, 5) flattened after axis 2 as InnerProduct(axis 2); x_static (N, 2, 2)
    bottom = [blob_of(np.zeros((4, 2, 5))), blob_of(np.zeros((4, 2)))]
    if static:
        bottom.append(blob_of(np.zeros((2, 2, 2))))
    t = tops(1)
    layer = make(spec(kind, 3), bottom, t)
    assert [b.shape for b in layer.blobs] == shapes
    assert t[0].shape == (4, 2, 3)


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_expose_hidden_adds_state_bottoms_and_tops(kind) -> None:
    n_states = len(STATES[kind])
    bottom = recurrent_inputs(kind, 3, 2, 4, static=True, expose=True)
    t = tops(1 + n_states)
    make(spec(kind, 4, expose=True), bottom, t)
    assert [b.shape for b in t] == [(3, 2, 4)] + [(1, 2, 4)] * n_states
    with pytest.raises(LayerError, match="top"):
        make(spec(kind, 4, expose=True), bottom, tops(1))
    with pytest.raises(LayerError, match="bottom"):
        make(spec(kind, 4, expose=True), bottom[:2], tops(1 + n_states))


def test_lstm_unit_builds_and_checks_shapes() -> None:
    bottom = [blob_of(np.zeros((1, 3, 2))), blob_of(np.zeros((1, 3, 8))),
              blob_of(np.ones((1, 3)))]
    t = tops(2)
    make("name:'unit' type:'LSTMUnit'", bottom, t)
    assert t[0].shape == t[1].shape == (1, 3, 2)
    with pytest.raises(LayerError, match="4 x 2"):
        make("name:'unit' type:'LSTMUnit'", [bottom[0], blob_of(np.zeros((1, 3, 6))),
                                             bottom[2]], tops(2))


def test_recurrent_net_from_prototxt() -> None:
    net = Net(parse_net_text("""
        name: 'rnn_net'
        layer { name:'x' type:'Input' top:'x' input_param { shape { dim: 5 dim: 2 dim: 3 } } }
        layer { name:'cont' type:'Input' top:'cont' input_param { shape { dim: 5 dim: 2 } } }
        layer { name:'lstm' type:'LSTM' bottom:'x' bottom:'cont' top:'h'
                recurrent_param { num_output: 4 weight_filler { type:'xavier' } } }
        layer { name:'rnn' type:'RNN' bottom:'h' bottom:'cont' top:'o'
                recurrent_param { num_output: 2 weight_filler { type:'xavier' } } }
    """))
    assert [p.shape for p in net.params["lstm"]] == [(16, 3), (16,), (16, 4)]
    assert [p.shape for p in net.params["rnn"]] == [(2, 4), (2,), (2, 2), (2, 2), (2,)]
    out = net.forward(x=np.ones((5, 2, 3)), cont=np.ones((5, 2)))
    assert out["o"].shape == (5, 2, 2) and np.isfinite(out["o"]).all()


def test_caffe_weights_load_into_their_blobs() -> None:
    """A caffemodel layer holds the unrolled net's parameters in order: they land there."""
    net = Net(parse_net_text("""
        layer { name:'x' type:'Input' top:'x' input_param { shape { dim: 2 dim: 1 dim: 3 } } }
        layer { name:'cont' type:'Input' top:'cont' input_param { shape { dim: 2 dim: 1 } } }
        layer { name:'lstm' type:'LSTM' bottom:'x' bottom:'cont' top:'h'
                recurrent_param { num_output: 2 } }
    """))
    rng = np.random.default_rng(5)
    caffe_blobs = [rng.standard_normal(s).astype(np.float32) for s in [(8, 3), (8,), (8, 2)]]
    model = caffe_pb2.NetParameter()
    layer = model.layer.add(name="lstm", type="LSTM")
    for a in caffe_blobs:
        layer.blobs.add().CopyFrom(array_to_blob(a))
    copy_weights_into(net, model)
    for mine, want in zip(net.params["lstm"], caffe_blobs):
        np.testing.assert_array_equal(mine.data, want)


def test_bad_inputs_are_named() -> None:
    bottom = recurrent_inputs("LSTM", 3, 2, 2, static=False, expose=False)
    t = tops(1)
    layer = make(spec("LSTM", 2), bottom, t)
    with pytest.raises(LayerError, match="timesteps changed"):
        layer.reshape([blob_of(np.zeros((4, 2, 3, 1))), blob_of(np.zeros((4, 2)))], t)
    with pytest.raises(LayerError, match=r"indicators \(bottom 1\)"):
        layer.reshape([bottom[0], blob_of(np.zeros((3, 3)))], t)
    layer.forward(bottom, t)
    with pytest.raises(LayerError, match="sequence indicators"):
        layer.backward(t, [True, True], bottom)
    with pytest.raises(LayerError, match="num_output"):
        make("name:'r' type:'RNN' recurrent_param{num_output:0}", bottom, tops(1))
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)


def test_debug_info_is_accepted() -> None:
    """debug_info logs Caffe-style [Forward]/[Backward] lines and changes no number."""
    bottom = recurrent_inputs("RNN", 3, 2, 2, static=False, expose=False)
    plain, debug = tops(1), tops(1)
    a = make(spec("RNN", 2), bottom, plain)
    b = make(spec("RNN", 2).replace("recurrent_param{", "recurrent_param{debug_info:true "),
             bottom, debug)
    for blob_a, blob_b in zip(a.blobs, b.blobs):
        blob_b.data[...] = blob_a.data
    for layer, t in ((a, plain), (b, debug)):
        layer.forward(bottom, t)
        t[0].diff[...] = 1
        layer.backward(t, [True, False], bottom)
    np.testing.assert_array_equal(plain[0].data, debug[0].data)
    for blob_a, blob_b in zip(a.blobs, b.blobs):
        np.testing.assert_array_equal(blob_a.diff, blob_b.diff)


# -- (2) values against Caffe's formulas ---------------------------------------------------
def test_lstm_unit_matches_caffes_formulas() -> None:
    rng = np.random.default_rng(1)
    c_prev, gates = rng.standard_normal((1, 3, 2)), 2 * rng.standard_normal((1, 3, 8))
    cont = np.array([[1.0, 0.0, 1.0]])
    bottom, t = [blob_of(c_prev), blob_of(gates), blob_of(cont)], tops(2)
    layer = make("name:'unit' type:'LSTMUnit'", bottom, t)
    layer.forward(bottom, t)
    c, h = unit_by_hand(c_prev, gates, cont)
    np.testing.assert_allclose(t[0].data, c, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t[1].data, h, rtol=1e-12, atol=1e-15)
    # cont 0: the previous cell is forgotten entirely
    hd = 2
    i, g = sig(gates[0, 1, :hd]), np.tanh(gates[0, 1, 3 * hd:])
    np.testing.assert_allclose(t[0].data[0, 1], i * g, rtol=1e-12)


def test_lstm_step_matches_hand_computation() -> None:
    """One step with given h_0, c_0 (expose_hidden) and a static input."""
    hd = 3
    bottom = recurrent_inputs("LSTM", 1, 2, hd, static=True, expose=True, seed=2)
    bottom[1].data[...] = [[1.0, 0.0]]
    t = tops(3)
    layer = make(spec("LSTM", hd, expose=True), bottom, t)
    layer.forward(bottom, t)
    w_xc, b_c, w_static, w_hc = (b.data for b in layer.blobs)
    x, cont, xs = bottom[0].data.reshape(1, 2, 3), bottom[1].data, bottom[2].data
    h0, c0 = bottom[3].data, bottom[4].data
    gates = x @ w_xc.T + b_c + xs @ w_static.T + (cont[..., None] * h0) @ w_hc.T
    c, h = unit_by_hand(c0, gates, cont)
    np.testing.assert_allclose(t[0].data, h, rtol=1e-12)
    np.testing.assert_allclose(t[1].data, h, rtol=1e-12)
    np.testing.assert_allclose(t[2].data, c, rtol=1e-12)


def test_rnn_step_matches_hand_computation() -> None:
    hd = 3
    bottom = recurrent_inputs("RNN", 1, 2, hd, static=False, expose=True, seed=3)
    bottom[1].data[...] = [[0.0, 1.0]]
    t = tops(2)
    layer = make(spec("RNN", hd, expose=True), bottom, t)
    layer.forward(bottom, t)
    w_xh, b_h, w_hh, w_ho, b_o = (b.data for b in layer.blobs)
    x, cont, h0 = bottom[0].data.reshape(1, 2, 3), bottom[1].data, bottom[2].data
    h = np.tanh(x @ w_xh.T + b_h + (cont[..., None] * h0) @ w_hh.T)
    np.testing.assert_allclose(t[0].data, np.tanh(h @ w_ho.T + b_o), rtol=1e-12)
    np.testing.assert_allclose(t[1].data, h, rtol=1e-12)


def run(kind: str, x: np.ndarray, cont: np.ndarray, weights: list[np.ndarray] | None = None,
        layer=None) -> tuple[np.ndarray, object]:
    """Forward x and cont through a layer (a new one with ``weights`` when none is given)."""
    bottom, t = [blob_of(x), blob_of(cont)], tops(1)
    if layer is None:
        layer = make(spec(kind, 3), bottom, t)
        for blob, w in zip(layer.blobs, weights or []):
            blob.data[...] = w
    layer.reshape(bottom, t)
    layer.forward(bottom, t)
    return t[0].data.copy(), layer


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_cont_zero_starts_a_fresh_sequence(kind) -> None:
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((3, 2, 2)), rng.standard_normal((4, 2, 2))
    cont = np.ones((7, 2))
    cont[0] = cont[3] = 0
    joined, layer = run(kind, np.concatenate([a, b]), cont)
    weights = [p.data.copy() for p in layer.blobs]
    alone, _ = run(kind, b, np.r_[np.zeros((1, 2)), np.ones((3, 2))], weights)
    np.testing.assert_allclose(joined[3:], alone, rtol=1e-12, atol=1e-14)
    assert not np.allclose(joined[:3], alone[:3])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
def test_state_carries_across_batches_until_cont_resets_it(kind) -> None:
    """Without expose_hidden a batch continues where the last one ended (cont 1), as one
    longer batch would; cont 0 or reset() starts afresh."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((3, 2, 2)), rng.standard_normal((3, 2, 2))
    first = np.r_[np.zeros((1, 2)), np.ones((2, 2))]
    _, layer = run(kind, a, first)
    weights = [p.data.copy() for p in layer.blobs]
    carried, _ = run(kind, b, np.ones((3, 2)), layer=layer)
    whole, _ = run(kind, np.concatenate([a, b]), np.r_[first, np.ones((3, 2))], weights)
    np.testing.assert_allclose(carried, whole[3:], rtol=1e-12, atol=1e-14)

    fresh, _ = run(kind, b, first, weights)
    restarted, _ = run(kind, b, first, layer=layer)
    np.testing.assert_allclose(restarted, fresh, rtol=1e-12, atol=1e-14)
    run(kind, a, first, layer=layer)
    layer.reset()
    zero_state, _ = run(kind, b, np.ones((3, 2)), layer=layer)
    np.testing.assert_allclose(zero_state, fresh, rtol=1e-12, atol=1e-14)


def test_float32_stays_float32() -> None:
    bottom = [blob_of(np.ones((3, 2, 4), np.float32)), blob_of(np.ones((3, 2), np.float32))]
    t = tops(1, np.float32)
    layer = make(spec("LSTM", 2), bottom, t)
    layer.forward(bottom, t)
    t[0].diff[...] = 1
    layer.backward(t, [True, False], bottom)
    for arr in (t[0].data, bottom[0].diff, *(p.data for p in layer.blobs),
                *(p.diff for p in layer.blobs)):
        assert arr.dtype == np.float32


# -- (3) gradients -------------------------------------------------------------------------
def test_lstm_unit_gradients() -> None:
    rng = np.random.default_rng(7)
    bottom = [blob_of(rng.standard_normal((1, 3, 2))), blob_of(rng.standard_normal((1, 3, 8))),
              blob_of(np.array([[1.0, 0.0, 1.0]]))]
    t = tops(2)
    layer = make("name:'unit' type:'LSTMUnit'", bottom, t)
    check_layer_gradients(layer, bottom, t, check_bottom=[0, 1])


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static, expose", [(False, False), (True, False), (False, True),
                                            (True, True)])
def test_recurrent_gradients(kind, static, expose) -> None:
    """Every parameter blob, x, x_static and (expose_hidden) the initial states, with the
    final-state tops weighted into the objective too."""
    bottom = recurrent_inputs(kind, 4, 2, 2, static, expose, seed=8)
    t = tops(1 + (len(STATES[kind]) if expose else 0))
    layer = make(spec(kind, 2, expose), bottom, t)
    check_layer_gradients(layer, bottom, t,
                          check_bottom=[i for i in range(len(bottom)) if i != 1])


def test_parameter_gradients_accumulate() -> None:
    bottom = recurrent_inputs("LSTM", 3, 2, 2, static=False, expose=False)
    t = tops(1)
    layer = make(spec("LSTM", 2), bottom, t)
    layer.forward(bottom, t)
    t[0].diff[...] = 1
    layer.backward(t, [True, False], bottom)
    once = [p.diff.copy() for p in layer.blobs]
    layer.backward(t, [True, False], bottom)
    for p, d in zip(layer.blobs, once):
        np.testing.assert_allclose(p.diff, 2 * d)


# -- (4) Caffe's recurrent example flow ----------------------------------------------------
SINE_NET = """
name: 'sine_lstm'
layer { name: 'data' type: 'HDF5Data' top: 'data' top: 'cont' top: 'label'
        hdf5_data_param { source: 'sine_list.txt' batch_size: 20 } }
layer { name: 'lstm' type: 'LSTM' bottom: 'data' bottom: 'cont' top: 'lstm'
        recurrent_param { num_output: 16
                          weight_filler { type: 'uniform' min: -0.08 max: 0.08 }
                          bias_filler { type: 'constant' value: 0 } } }
layer { name: 'predict' type: 'InnerProduct' bottom: 'lstm' top: 'predict'
        inner_product_param { num_output: 1 axis: 2
                              weight_filler { type: 'gaussian' std: 0.1 }
                              bias_filler { type: 'constant' value: 0 } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'predict' bottom: 'label' top: 'loss' }
"""

SINE_SOLVER = """
net: 'sine_lstm.prototxt'
base_lr: 0.1  momentum: 0.9  lr_policy: 'fixed'
max_iter: 300  display: 0  random_seed: 1701
snapshot_after_train: false  solver_mode: CPU
"""


def write_sine_task(folder: Path, length: int = 400, streams: int = 8) -> None:
    """Caffe's recurrent data layout as HDF5 rows of time steps: data, cont and label are
    (time, stream, ...); the label is the next value of each stream's sine wave. Batches of
    20 consecutive rows are read in order, each continuing the last (cont 1) except at the
    very start, where cont 0 begins every stream's sequence."""
    import h5py
    phase = np.arange(length + 1)[:, None] * 0.25 + np.arange(streams)[None, :] * 0.7
    wave = np.sin(phase).astype(np.float32)
    cont = np.ones((length, streams), np.float32)
    cont[0] = 0
    with h5py.File(folder / "sine.h5", "w") as f:
        f["data"] = wave[:-1, :, None]
        f["cont"] = cont
        f["label"] = wave[1:, :, None]
    (folder / "sine_list.txt").write_text("sine.h5\n")


def test_lstm_learns_to_predict_a_sine_wave(tmp_path: Path) -> None:
    write_sine_task(tmp_path)
    (tmp_path / "sine_lstm.prototxt").write_text(SINE_NET)
    (tmp_path / "solver.prototxt").write_text(SINE_SOLVER)
    solver = Solver(tmp_path / "solver.prototxt")
    losses: list[float] = []

    class Record:
        def on_iteration(self, _solver: Solver, loss: float) -> None:
            losses.append(loss)

    solver.add_callback(Record())
    solver.step(300)
    solver.close()
    assert len(losses) == 300 and np.isfinite(losses).all()
    final = float(np.mean(losses[-20:]))
    assert final < 0.3 * losses[0], (losses[0], final)
    # Without memory of the past the best guess of sin(t + 0.25) from sin(t) alone is
    # cos(0.25) sin(t), a loss of about 8 * sin(0.25)^2 / 4 = 0.12 per batch: well under it,
    # the LSTM must be using its state.
    assert final < 0.05, final
