"""Property tests: no mutated prototxt, caffemodel, solverstate, binaryproto, wire message or
sequence of a large message's pieces ends in a crash or a hang, only in a clean one-line error or a valid result (tests/fuzzing.py;
`python -m tests.fuzzing` runs 10,000 cases per target on demand)."""
from __future__ import annotations

import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzzing import make_targets, outcome

TARGETS = ["prototxt", "caffemodel", "solverstate", "binaryproto", "wire", "wire-auth",
           "wire-pieces"]
FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    comm = logging.getLogger("poseidon.comm")
    level = comm.level
    comm.setLevel(logging.ERROR)  # the dropped-message warnings, by the hundred
    try:
        with make_targets(tmp_path_factory.mktemp("fuzz")) as made:
            yield made
    finally:
        comm.setLevel(level)


@pytest.mark.parametrize("name", TARGETS)
@FUZZ
@given(rng=st.randoms(use_true_random=False))
def test_mutated_inputs_fail_cleanly(name, rng: random.Random, targets):
    target = targets[name]
    result, detail = outcome(target, target.mutate(rng))
    assert result in ("ok", "clean"), detail


@pytest.mark.parametrize("name", ["caffemodel", "solverstate", "binaryproto"])
@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_fail_cleanly(name, data: bytes, targets):
    result, detail = outcome(targets[name], data)
    assert result in ("ok", "clean"), detail


def test_the_seeds_themselves_are_accepted(targets):
    """Each target's unmutated input is valid: the fuzzing starts from real inputs."""
    for name in TARGETS:
        t = targets[name]
        assert outcome(t, t.seed) == ("ok", ""), name
