"""Update rules and learning-rate policies against hand computations (engine/solvers.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.pb import caffe_pb2
from engine.kernels import cpu as compiled
from engine.solvers import (RULES, SolverError, check_lr_policy, clip_scale, learning_rate,
                            make_rule, normalize, regularize, solver_type)


def sp(**fields) -> caffe_pb2.SolverParameter:
    p = caffe_pb2.SolverParameter()
    for k, v in fields.items():
        if isinstance(v, list):
            getattr(p, k).extend(v)
        else:
            setattr(p, k, v)
    return p


G = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
W = np.array([1.0, -2.0, 0.5, -0.25], dtype=np.float32)


def run_rule(param, grads, rate=0.1, start_iter=0):
    """Apply a rule for len(grads) iterations to W; returns (data, history)."""
    rule = make_rule(param)
    data = W.copy()
    hist = [np.zeros_like(W) for _ in range(rule.histories)]
    for t, g in enumerate(grads):
        diff = np.asarray(g, dtype=np.float32).copy()
        rule.compute(diff, hist, rate, start_iter + t)
        data -= diff
    return data, hist


# -- learning-rate policies --------------------------------------------------------------
@pytest.mark.parametrize("fields,it,expected", [
    (dict(lr_policy="fixed", base_lr=0.01), 77, 0.01),
    (dict(lr_policy="step", base_lr=0.1, gamma=0.5, stepsize=10), 25, 0.1 * 0.5 ** 2),
    (dict(lr_policy="exp", base_lr=0.1, gamma=0.99), 3, 0.1 * 0.99 ** 3),
    (dict(lr_policy="inv", base_lr=0.01, gamma=1e-4, power=0.75), 1, 0.01 * (1 + 1e-4) ** -0.75),
    (dict(lr_policy="inv", base_lr=0.01, gamma=1e-4, power=0.75), 199, 0.01 * (1 + 1e-4 * 199) ** -0.75),
    (dict(lr_policy="poly", base_lr=0.1, power=2.0, max_iter=100), 30, 0.1 * (1 - 0.3) ** 2),
    (dict(lr_policy="sigmoid", base_lr=0.1, gamma=-0.1, stepsize=50), 40,
     0.1 / (1 + math.exp(0.1 * (40 - 50)))),
])
def test_lr_policies(fields, it, expected):
    rate, _ = learning_rate(sp(**fields), it, 0)
    assert rate == pytest.approx(expected, rel=1e-6)


def test_lr_inv_matches_caffe_log_digits():
    # train_lenet.log: "Iteration 1, lr = 0.00999925", "Iteration 199, lr = 0.0098533"
    p = sp(lr_policy="inv", base_lr=0.01, gamma=1e-4, power=0.75)
    assert "%g" % learning_rate(p, 1, 0)[0] == "0.00999925"
    assert "%g" % learning_rate(p, 199, 0)[0] == "0.0098533"


def test_multistep_advances_one_step_per_call():
    p = sp(lr_policy="multistep", base_lr=1.0, gamma=0.1, stepvalue=[2, 4])
    step, rates = 0, []
    for it in range(6):
        rate, step = learning_rate(p, it, step)
        rates.append(rate)
    assert rates == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    assert step == 2
    # resumed at iteration 5 from current_step 0: Caffe moves one step per call
    assert learning_rate(p, 5, 0) == (pytest.approx(0.1), 1)


@pytest.mark.parametrize("fields,msg", [
    (dict(lr_policy="cosine"), "unknown lr_policy"),
    (dict(lr_policy="step"), "stepsize"),
    (dict(lr_policy="poly"), "max_iter"),
])
def test_bad_lr_policy(fields, msg):
    with pytest.raises(SolverError, match=msg):
        check_lr_policy(sp(**fields))


# -- preprocessing ---------------------------------------------------------------------------
def test_normalize_regularize_clip():
    d = G.copy()
    normalize(d, 4)
    np.testing.assert_allclose(d, G / 4)
    d = G.copy()
    regularize(W, d, 0.01, "L2")
    np.testing.assert_allclose(d, G + 0.01 * W, rtol=1e-6)
    d = G.copy()
    regularize(W, d, 0.01, "L1")
    np.testing.assert_allclose(d, G + 0.01 * np.sign(W), rtol=1e-6)
    with pytest.raises(SolverError, match="regularization_type"):
        regularize(W, G.copy(), 0.01, "L3")
    norm = math.sqrt(0.25 + 1 + 4)
    assert clip_scale([G[:2], G[2:]], 1.0) == (pytest.approx(norm, rel=1e-6), pytest.approx(1 / norm, rel=1e-6))
    assert clip_scale([G], 10.0) is None
    assert clip_scale([G], -1) is None


# -- update rules -----------------------------------------------------------------------------
def test_sgd_momentum():
    g1, g2 = G, G[::-1].copy()
    data, (h,) = run_rule(sp(type="SGD", momentum=0.9), [g1, g2], rate=0.1)
    h1 = 0.1 * g1
    h2 = 0.9 * h1 + 0.1 * g2
    np.testing.assert_allclose(h, h2, rtol=1e-6)
    np.testing.assert_allclose(data, W - h1 - h2, rtol=1e-6)


def test_nesterov():
    g1, g2 = G, G[::-1].copy()
    data, (h,) = run_rule(sp(type="Nesterov", momentum=0.9), [g1, g2], rate=0.1)
    h1 = 0.1 * g1
    u1 = 1.9 * h1 - 0.9 * 0
    h2 = 0.9 * h1 + 0.1 * g2
    u2 = 1.9 * h2 - 0.9 * h1
    np.testing.assert_allclose(h, h2, rtol=1e-6)
    np.testing.assert_allclose(data, W - u1 - u2, rtol=1e-6, atol=1e-7)


def test_adagrad():
    g1, g2 = G, G[::-1].copy()
    data, (h,) = run_rule(sp(type="AdaGrad", delta=1e-8), [g1, g2], rate=0.1)
    h1 = g1.astype(np.float64) ** 2
    u1 = 0.1 * g1 / (np.sqrt(h1) + 1e-8)
    h2 = h1 + g2.astype(np.float64) ** 2
    u2 = 0.1 * g2 / (np.sqrt(h2) + 1e-8)
    np.testing.assert_allclose(h, h2, rtol=1e-6)
    np.testing.assert_allclose(data, W - u1 - u2, rtol=1e-5, atol=1e-6)


def test_rmsprop():
    g1, g2 = G, G[::-1].copy()
    data, (h,) = run_rule(sp(type="RMSProp", rms_decay=0.9, delta=1e-6), [g1, g2], rate=0.01)
    h1 = 0.1 * g1.astype(np.float64) ** 2
    u1 = 0.01 * g1 / (np.sqrt(h1) + 1e-6)
    h2 = 0.9 * h1 + 0.1 * g2.astype(np.float64) ** 2
    u2 = 0.01 * g2 / (np.sqrt(h2) + 1e-6)
    np.testing.assert_allclose(h, h2, rtol=1e-6)
    np.testing.assert_allclose(data, W - u1 - u2, rtol=1e-5, atol=1e-6)


def test_adadelta_history_order():
    g1, g2 = G, G[::-1].copy()
    m, d, lr = 0.95, 1e-6, 1.0
    data, (hg, hu) = run_rule(sp(type="AdaDelta", momentum=m, delta=d), [g1, g2], rate=lr)
    eg = eu = np.zeros(4)
    w = W.astype(np.float64)
    for g in (g1, g2):
        g = g.astype(np.float64)
        eg = m * eg + (1 - m) * g * g
        upd = g * np.sqrt((eu + d) / (eg + d))
        eu = m * eu + (1 - m) * upd * upd
        w = w - lr * upd
    # history[0] is the squared-gradient history, history[1] the squared-update history
    np.testing.assert_allclose(hg, eg, rtol=1e-5)
    np.testing.assert_allclose(hu, eu, rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(data, w, rtol=1e-5)


def test_adam_bias_correction_uses_iteration():
    p = sp(type="Adam", momentum=0.9, momentum2=0.999, delta=1e-8)
    # the proto's floats, as Caffe sees them (1 - 0.999f is not 0.001)
    b1, b2, eps, lr = p.momentum, p.momentum2, p.delta, 0.001
    g1, g2 = G, G[::-1].copy()
    data, (m, v) = run_rule(p, [g1, g2], rate=lr, start_iter=10)
    mm = vv = np.zeros(4)
    w = W.astype(np.float64)
    for t, g in zip((11, 12), (g1, g2)):
        g = g.astype(np.float64)
        mm = b1 * mm + (1 - b1) * g
        vv = b2 * vv + (1 - b2) * g * g
        corr = math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        w = w - lr * corr * mm / (np.sqrt(vv) + eps)
    np.testing.assert_allclose(m, mm, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(v, vv, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(data, w, rtol=1e-5)


def test_history_counts_and_float32():
    assert {n: RULES[n].histories for n in RULES} == {
        "SGD": 1, "Nesterov": 1, "AdaGrad": 1, "RMSProp": 1, "AdaDelta": 2, "Adam": 2}
    data, hist = run_rule(sp(type="Adam", momentum=0.9, momentum2=0.999), [G], rate=0.1)
    assert data.dtype == np.float32 and all(h.dtype == np.float32 for h in hist)


def test_v1_solver_type_and_checks():
    assert solver_type(sp(solver_type=caffe_pb2.SolverParameter.ADADELTA)) == "AdaDelta"
    assert solver_type(sp()) == "SGD"
    with pytest.raises(SolverError, match="unknown type"):
        solver_type(sp(type="Lion"))
    with pytest.raises(SolverError, match="disagree"):
        solver_type(sp(type="SGD", solver_type=caffe_pb2.SolverParameter.ADAM))
    with pytest.raises(SolverError, match="momentum cannot be used with AdaGrad"):
        make_rule(sp(type="AdaGrad", momentum=0.9))
    with pytest.raises(SolverError, match="rms_decay"):
        make_rule(sp(type="RMSProp", rms_decay=1.5))


@pytest.mark.skipif(not compiled.available(), reason="needs Numba (pip install 'poseidon[fast]')")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("workers,iter_size,decay", [(1, 1, 0.0), (1, 1, 5e-4), (2, 1, 5e-4),
                                                     (3, 2, 5e-4), (4, 3, 0.0), (3, 1, 0.0)])
def test_the_compiled_sgd_step_equals_numpys_to_the_bit(dtype, workers, iter_size, decay):
    """The mean of summed workers, Normalize, L2 Regularize and the momentum in one compiled
    pass, against the NumPy forms one after another (solvers.Preprocess, then SGD's
    compute with Numba off)."""
    from engine.solvers import Preprocess
    rng = np.random.default_rng(3)
    h, d, x = (rng.standard_normal(10007).astype(dtype) for _ in range(3))
    want_h, want_d = h.copy(), d.copy()
    Preprocess(workers, iter_size, float(np.float32(decay)), "L2").apply(x, want_d)
    want_h *= np.float32(0.9)
    want_h += np.float32(0.013) * want_d
    want_d[...] = want_h
    assert compiled.sgd_step(h, d, x, workers, iter_size, np.float32(decay), np.float32(0.9),
                             np.float32(0.013))
    assert np.array_equal(h, want_h) and np.array_equal(d, want_d)
    assert not compiled.sgd_step(h[::2], d[::2], x[::2], 1, 1, np.float32(0), np.float32(0.9),
                                 np.float32(0.013))


def test_the_mean_over_a_power_of_two_multiplies_and_keeps_every_bit():
    """The update's mean of P workers' sum (``normalize``) multiplies by 1/P when P is a
    power of two (exact, and 2.3x faster than a divide here): the bits equal the divide's for
    every float, subnormals, infinities and NaN included; any other P divides."""
    from engine.solvers import normalize
    rng = np.random.default_rng(0)
    for dtype, bits in ((np.float32, np.uint32), (np.float64, np.uint64)):
        info = np.finfo(dtype)
        scales = np.repeat([1e-40, 1.0, 1e30, float(info.max) / 16], 10000)
        x = (rng.standard_normal(40000) * scales).astype(dtype)
        x[:9] = [0.0, -0.0, np.inf, -np.inf, np.nan, info.tiny, info.smallest_subnormal,
                 3 * info.smallest_subnormal, info.max]
        for world in (1, 2, 4, 8, 64, 3, 6):
            got, want = x.copy(), np.empty_like(x)
            normalize(got, 1, world)
            np.divide(x, world, out=want)
            assert got.dtype == dtype
            assert np.array_equal(got.view(bits), want.view(bits)), (dtype, world)
    # a changed division would show: 1/3 is not exact, so a multiply by it differs
    y = np.float32([1.0, 7.0, 10.0])
    assert not np.array_equal(y * np.float32(1 / 3), y / np.float32(3))
