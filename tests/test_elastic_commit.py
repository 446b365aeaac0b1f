"""The elastic commit: the state a snapshot holds, kept in memory, restored, handed over.

A Solver that goes on from a commit must equal one resumed from the snapshot of that
iteration (the same arrays, counters and data positions), bit for bit; a commit of another net
is refused before anything changes; a joining worker gets the commit over an authenticated
endpoint, every piece checked against its own arrays.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.comm.errors import CommError
from engine.comm.handover import pieces, receive_commit, send_commit
from engine.comm.transport import WORKER, Endpoint
from engine.solver import Solver
from engine.solvers import SolverError
from tests.test_comm_train import digits_db, write_run  # noqa: F401
from tests.test_comm_transport import KEY, local_hosts


def params(solver: Solver) -> list[np.ndarray]:
    return [np.array(b.data) for layer in solver.net.layers for b in layer.blobs]


def test_going_on_from_a_commit_equals_resuming_from_the_snapshot(digits_db, tmp_path):  # noqa: F811
    solver_file = write_run(tmp_path, digits_db, 8, "c", iters=12)
    first = Solver(str(solver_file))
    first.step(5)
    commit = first.commit()
    first.snapshot()
    first.step(3)  # the commit is a copy: training on does not change it
    assert not all(np.array_equal(a, b) for a, b in zip(params(first), commit.arrays))
    from_commit, from_file = Solver(str(solver_file)), Solver(str(solver_file))
    from_commit.restore_commit(commit)
    from_file.restore(tmp_path / "c_iter_5.solverstate")
    for s in (from_commit, from_file):
        assert s.iter == 5 and [layer.position() for layer in s.net.data_layers] == [40]
        s.step(7)
    for a, b in zip(params(from_commit), params(from_file)):
        assert np.array_equal(a, b)
    for a, b in zip(from_commit.history, from_file.history):
        assert np.array_equal(a, b)
    for s in (first, from_commit, from_file):
        s.close()


def test_a_commit_into_a_spare_overwrites_its_arrays(digits_db, tmp_path):  # noqa: F811
    s = Solver(str(write_run(tmp_path, digits_db, 8, "s", iters=12)))
    old = s.commit()
    s.step(3)
    new = s.commit(into=old)
    assert new.iter == 3 and all(a is b for a, b in zip(new.arrays, old.arrays))
    assert all(np.array_equal(a, b) for a, b in zip(new.arrays, params(s) + s.history))
    s.close()


def test_a_commit_written_to_disk_is_the_snapshot_of_its_iteration(digits_db, tmp_path):  # noqa: F811
    solver_file = write_run(tmp_path, digits_db, 8, "w", iters=12)
    s = Solver(str(solver_file))
    s.step(4)
    commit = s.commit()
    s.step(2)
    written = s.write_commit(commit)
    assert written == tmp_path / "w_iter_4.solverstate"
    again = Solver(str(solver_file))
    again.restore(written)
    assert again.iter == 4
    for a, b in zip(params(again), commit.arrays):
        assert np.array_equal(a, b)
    s.close()
    again.close()


def test_a_commit_of_another_net_is_refused_and_changes_nothing(digits_db, tmp_path):  # noqa: F811
    small = Solver(str(write_run(tmp_path / "a", digits_db, 8, "a", iters=2)))
    other = write_run(tmp_path / "b", digits_db, 8, "b", iters=2)
    other.parent.joinpath("b_net.prototxt").write_text(
        other.parent.joinpath("b_net.prototxt").read_text().replace("num_output: 256",
                                                                    "num_output: 128"))
    big = Solver(str(other))
    before = params(small)
    with pytest.raises(SolverError, match=r"commit array 2 is float32\(128, 512\), net "
                                          r"'CommNet' has float32\(256, 512\)"):
        small.restore_commit(big.commit())
    assert all(np.array_equal(a, b) for a, b in zip(before, params(small)))
    small.close()
    big.close()


def test_pieces_cover_every_array_once_within_the_size():
    arrays = [np.zeros(10, np.float32), np.zeros(0, np.float32), np.zeros((3, 3), np.float32)]
    cut = pieces(arrays, 16)  # 4 float32 values a piece
    assert [(p.array, p.offset, p.count) for p in cut] == [
        (0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 0), (2, 0, 4), (2, 4, 4), (2, 8, 1)]


def handover(sent: list[np.ndarray], templates: list[np.ndarray],
             chunk: int = 64) -> tuple[object, ...]:
    """Rank 0 sends ``sent`` as the commit of iteration 7 to worker 1, which expects
    ``templates``; what worker 1 got, or the error it raised."""
    hosts = local_hosts(2)
    a = Endpoint((WORKER, 0), hosts, [(WORKER, 1)], key=KEY, timeout=10)
    b = Endpoint((WORKER, 1), hosts, [(WORKER, 0)], key=KEY, timeout=10)
    out: list[object] = []

    def receive() -> None:
        try:
            out.append(receive_commit(b, templates, 7, 1, chunk))
        except CommError as e:
            out.append(e)

    t = threading.Thread(target=receive)
    t.start()
    try:
        send_commit(a, [(WORKER, 1)], sent, 7, 3, [560], chunk)
        t.join(30)
    finally:
        a.close()
        b.close()
    assert not t.is_alive()
    return tuple(out)


def test_a_joining_worker_receives_the_commit_over_the_endpoint():
    rng = np.random.default_rng(0)
    sent = [rng.standard_normal((5, 7)).astype(np.float32), rng.standard_normal(3).astype(
        np.float32)]
    [got] = handover(sent, [np.zeros_like(a) for a in sent])
    assert got.current_step == 3 and got.data_positions == [560]
    for a, b in zip(sent, got.arrays):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_a_commit_piece_that_does_not_fit_the_receivers_net_is_named():
    sent = [np.ones(20, np.float32), np.ones(3, np.float64)]
    [err] = handover(sent, [np.zeros(20, np.float32), np.zeros(3, np.float32)])
    assert isinstance(err, CommError)
    assert "worker 0 (127.0.0.1:" in str(err) and "commit piece 2" in str(err)
    assert "as float64(3,), expected array 1 offset 0 of commit 7 as float32(3,)" in str(err)
