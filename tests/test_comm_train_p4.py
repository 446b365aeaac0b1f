"""`poseidon train --hosts` with 4 local workers: equal to one worker with 4x the batch."""
from __future__ import annotations

import pytest

from tests.test_comm_train import (  # noqa: F401
    check_p_workers_equal_one_worker,
    digits_db,
    mnist_db,
    net_case,
    reference,
)

#: it starts processes or trains: its file starts first (tests/conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.numpy_kernels]


@pytest.mark.parametrize("comm", ["ps", "sfb", "hybrid", "ring", "hd"])
def test_four_workers_equal_one_worker_with_four_times_the_batch(comm, net_case, reference,  # noqa: F811
                                                                 tmp_path):
    check_p_workers_equal_one_worker(4, comm, net_case, reference, tmp_path)
