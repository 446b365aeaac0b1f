"""Shared test fixtures: where ../shared is, and skipping cleanly when it is absent."""
from __future__ import annotations

import compileall
import os
import signal
import sys
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("POSEIDON_SHARED", ROOT.parent / "shared"))


# pytest-xdist's workers ignore SIGINT, and a process started from one would inherit that and never
# hear the Ctrl-C a test sends it (Python installs its KeyboardInterrupt handler only where SIGINT
# is not ignored). A handler, unlike SIG_IGN, is not inherited across exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the project once, before the workers start: the suite starts about a
    thousand Python processes (workers, shards, commands), and where PYTHONDONTWRITEBYTECODE
    is set (as in the sandboxes this project runs in) none of them would write its .pyc, so each compiled every
    module of engine/ and poseidon_cli/ again (0.1 s of CPU each). Reading .pyc files is not
    affected by the variable; a stale one is recompiled, as Python always does."""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):
        for folder in ("engine", "poseidon_cli"):
            compileall.compile_dir(ROOT / folder, quiet=1)
    _own_ports(getattr(config, "workerinput", None))


def _own_ports(workerinput: dict | None) -> None:
    """Each pytest-xdist worker draws its ports from a slice of the range of its own
    (POSEIDON_PORTS, which the jobs its tests start inherit): ports probed free are released
    before the workers bind them, and two tests running at once on two workers once drew the
    same ones ("cannot bind port 27305 (held by pid 26236 (python))"). One worker runs one
    test at a time, so its jobs never meet another's."""
    if not workerinput or "POSEIDON_PORTS" in os.environ:
        return
    from poseidon_cli.launch.hostfile import PORTS
    index = int(workerinput["workerid"].removeprefix("gw"))
    count = int(workerinput["workercount"])
    width = (PORTS[1] - PORTS[0]) // count
    low = PORTS[0] + index * width
    os.environ["POSEIDON_PORTS"] = f"{low}-{low + width}"


def shared_path(*parts: str) -> Path:
    """A path under ../shared, skipping the calling test when it is not there."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"needs {p} (the shared fixtures beside the checkout)")
    return p


@pytest.fixture
def shared() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"needs the shared fixtures at {SHARED}")
    return SHARED


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels() -> None:
    """The CPU kernels compiled once, up front, as `poseidon train` does on a machine's first
    run: no test's output or liveness bound then includes Numba compiling them (only the
    first session on a machine compiles; later ones find the stamp and return at once)."""
    from poseidon_cli.warming import warm_kernels

    warm_kernels(["float32"], lambda message: None, force=False)


@pytest.fixture(scope="module", autouse=True)
def numpy_kernels(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a file marked ``numpy_kernels``, POSEIDON_NUMBA=0 for its tests and every process
    they start. Such files start hundreds of worker processes in all, and each spent about a
    second importing Numba and loading its compiled kernels from the cache (test_comm_train.py:
    51.6 s of CPU against 40.8 without). The compiled forms equal the NumPy forms to the bit
    (tests/test_layers_vision.py and the kernels' own tests run both), so what these files
    assert, that distributed runs equal one worker, holds for either."""
    if request.node.get_closest_marker("numpy_kernels") is None:
        yield
        return
    before = os.environ.get("POSEIDON_NUMBA")
    os.environ["POSEIDON_NUMBA"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("POSEIDON_NUMBA", None)
        else:
            os.environ["POSEIDON_NUMBA"] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests (they start processes or train) first, then the rest by their
    number of tests, most first. pytest-xdist hands out whole files (``--dist loadfile``) in
    this order (``--no-loadscope-reorder``): the long files start early and the short ones
    fill in at the end, so the workers finish together instead of one waiting while the
    other runs a long file that came last."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def order(name: str) -> tuple[bool, int]:
        tests = files[name]
        return (not any(t.get_closest_marker("slow") for t in tests), -len(tests))

    items[:] = [item for name in sorted(files, key=order) for item in files[name]]
