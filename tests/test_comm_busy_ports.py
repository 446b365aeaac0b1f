"""A port that another process holds stops a distributed run at once, with one line naming the
port and, when /proc tells, the process that holds it. "At once" is measured against what the
run did, not the wall clock (a busy machine makes any fixed limit flaky): the launcher names the
port before a worker starts building its net."""
from __future__ import annotations

import os
import socket

import pytest

from tests.test_comm_train import digits_db, poseidon, write_hosts, write_run  # noqa: F401

pytestmark = pytest.mark.numpy_kernels


@pytest.mark.parametrize("who, offset", [("worker 1", 2), ("shard 1", 3)])
def test_a_busy_port_is_named_at_once(who, offset, digits_db, tmp_path):  # noqa: F811
    solver = write_run(tmp_path, digits_db, 8, "busy", iters=5)
    hosts, base = write_hosts(tmp_path, 2)
    port = base + offset  # worker 1 binds base + 2, its shard base + 3
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", port))
    squatter.listen()
    try:
        done = poseidon("train", "--solver", str(solver), "--hosts", str(hosts),
                        "--timeout", "20", timeout=120)
    finally:
        squatter.close()
    errors = [l for l in done.stderr.splitlines() if l.startswith("poseidon: error:")]
    assert done.returncode == 1
    assert len(errors) == 1, done.stderr[-3000:]
    assert "Initializing solver" not in done.stderr  # no worker built its net
    assert f"{who} (127.0.0.1:{port}): cannot bind port {port} (held by pid {os.getpid()} " \
        in errors[0], errors[0]
