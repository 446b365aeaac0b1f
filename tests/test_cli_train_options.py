"""`poseidon train`'s options: what its help lists is what it takes."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.comm.errors import CommError
from poseidon_cli.launch.config import JobConfig
from tests.test_cli_errors import run


def test_wire_help_and_behaviour_agree(tmp_path: Path):
    shown = run("train", "--help").stdout
    listed = re.search(r"--wire \[([a-z0-9|]+)\]", shown).group(1).split("|")
    assert "fp32" in listed and "fp16" in listed and "sparse" not in listed
    missing = tmp_path / "missing.prototxt"
    for wire in listed:
        assert JobConfig(solver="s.prototxt", wire=wire).wire == wire
        # past the option's check: the next thing said is about the solver file
        done = run("train", "--solver", str(missing), "-n", "2", "--wire", wire)
        assert done.returncode == 1 and f"solver file {missing} not found" in done.stderr
    refused = run("train", "--solver", str(missing), "-n", "2", "--wire", "sparse")
    assert refused.returncode == 2 and "'sparse' is not one of" in refused.stderr
    with pytest.raises(CommError, match="--wire must be one of"):
        JobConfig(solver="s.prototxt", wire="sparse")
