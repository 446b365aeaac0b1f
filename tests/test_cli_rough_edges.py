"""Small things a new user met: a mistyped LMDB path named once with the database beside it,
"1 worker", a reader that stops reading (`| head`), workers that outnumber the cores, and
--plot without matplotlib said before the work."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from poseidon_cli.console import plural

ROOT = Path(__file__).resolve().parent.parent


def test_a_mistyped_lmdb_path_is_named_once_with_the_database_beside_it(tmp_path):
    from engine.data.converters import convert_digits
    from engine.net import Net, NetError

    convert_digits(tmp_path)
    typo = tmp_path / "digits_trian_lmdb"
    net = tmp_path / "net.prototxt"
    net.write_text(f'layer {{ name: "d" type: "Data" top: "data" top: "label"\n'
                   f'  data_param {{ source: "{typo}" backend: LMDB batch_size: 4 }} }}\n')
    with pytest.raises(NetError) as e:
        Net(str(net), phase="TRAIN")
    message = str(e.value)
    assert message.count(str(typo)) == 1, message
    assert f"did you mean {tmp_path / 'digits_train_lmdb'}?" in message


def test_counts_say_one_worker_not_one_workers():
    assert (plural(1, "worker"), plural(2, "worker"), plural(1, "machine")) == \
        ("1 worker", "2 workers", "1 machine")


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`poseidon convert --info ... | head`: the pipe closes before the output is written."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before a byte is written: the first write fails
    proc = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "convert", "--info",
                           str(ROOT / "models" / "lenet" / "train_val.prototxt")],
                          cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=120)
    os.close(write)
    # nothing said, and non-zero as a tool that SIGPIPE ends (click's convention: 1)
    assert proc.stderr == "" and proc.returncode == 1, proc.stderr


@pytest.mark.parametrize("cores, load, says", [(2, 0.0, False), (2, 1.5, True), (8, 1.0, False)])
def test_workers_that_outnumber_the_cores_are_told_so(monkeypatch, cores, load, says):
    from poseidon_cli.commands import train
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    line = train.crowding(2)
    assert (line is not None) == says
    if says:
        assert line.startswith(f"2 workers on {cores} cores, which other processes already "
                               f"keep {load:.1f} busy")


def test_plot_without_matplotlib_is_said_before_the_work(monkeypatch, tmp_path):
    from poseidon_cli.main import cli
    from poseidon_cli.options import NO_MATPLOTLIB

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    # a model that does not exist: the matplotlib line comes first, before any work
    done = CliRunner().invoke(cli, ["simulate", "--model", str(tmp_path / "none.prototxt"),
                                    "--plot", str(tmp_path / "speedup.png")])
    assert done.exit_code != 0
    assert done.output.strip().splitlines()[-1] == f"poseidon: error: {NO_MATPLOTLIB}"
