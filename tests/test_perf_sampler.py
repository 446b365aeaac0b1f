"""The bench cluster's counter sampler: growth over a window, interpolated between samples."""
from __future__ import annotations

import pytest

from poseidon_cli.benches.cluster import Sampler, utilisation


def sampled(points: list[tuple[float, list[int]]]) -> Sampler:
    s = Sampler(lambda: [0])
    s.samples = list(points)
    return s


def test_growth_over_a_window_is_interpolated_between_samples():
    s = sampled([(10.0, [0, 0]), (11.0, [100, 1000]), (12.0, [300, 1000])])
    assert s.delta(10.0, 12.0) == [300, 1000]
    assert s.delta(10.5, 11.5) == pytest.approx([150, 500])   # half of each interval
    # a window shorter than the period gets its interval's rate
    assert s.delta(11.2, 11.3) == pytest.approx([20, 0])
    # outside the samples: clamped to the first and last
    assert s.delta(5.0, 20.0) == [300, 1000]


def test_cpu_utilisation_is_busy_over_total():
    cpu = sampled([(0.0, [0, 0]), (1.0, [150, 200]), (2.0, [170, 400])])
    assert utilisation(cpu, 0.0, 1.0) == pytest.approx(0.75)
    assert utilisation(cpu, 1.25, 1.75) == pytest.approx(0.1)
    assert utilisation(sampled([]), 0.0, 1.0) != utilisation(sampled([]), 0.0, 1.0)  # nan


def test_a_sampler_reads_at_start_and_end():
    values = iter(range(100))
    with Sampler(lambda: [next(values)], period=10.0) as s:
        pass
    assert [c for _, c in s.samples] == [[0], [1]]


def test_iteration_times_cross_midnight():
    """A run that crosses midnight: each line is dated by its own glog month and day, so the
    period between the last iteration of one day and the first of the next is 1 s, not -86399."""
    from poseidon_cli.benches.cluster import iteration_times

    log = ("I1125 23:59:59.500000 7 solver.py:1] Iteration 4 (1 iter/s, 1s/1 iters), loss = 1\n"
           "I1126 00:00:00.500000 7 solver.py:1] Iteration 5 (1 iter/s, 1s/1 iters), loss = 1\n")
    times = iteration_times(log)
    assert times[5] - times[4] == pytest.approx(1.0)
