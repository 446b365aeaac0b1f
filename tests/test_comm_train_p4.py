"""`poseidon train --hosts` with 4 local workers: equal to one worker with 4x the batch."""
from __future__ import annotations

import pytest

from tests.test_comm_train import check_p_workers_equal_one_worker, digits_db, reference  # noqa: F401


@pytest.mark.parametrize("comm", ["ps", "sfb", "hybrid"])
def test_four_workers_equal_one_worker_with_four_times_the_batch(comm, digits_db, reference,  # noqa: F811
                                                                 tmp_path):
    check_p_workers_equal_one_worker(4, comm, digits_db, reference, tmp_path)
