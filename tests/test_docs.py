"""The documentation a clone carries: every relative link in the README and docs/ points at a
file of the checkout, and nothing sends a user to files beside it (../shared is the developers'
fixtures, which a user's clone does not have)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "models").glob("**/README.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_checkout(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    for target in targets:
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(ROOT), f"{doc.name} links outside the checkout: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


def test_the_architecture_is_in_the_checkout() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/DESIGN.md)" in readme
    assert "shared/DESIGN.md" not in readme
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    for section in ("## The floors", "## The gradient's path", "## The schemes",
                    "## The plan and the cost model", "## The wire", "## Launch",
                    "## Performance tools"):
        assert section in design


def test_the_docs_site_builds_strictly(tmp_path) -> None:
    """mkdocs.yml's site: every page in the nav, every link between pages and to a heading
    resolves (``strict``: a warning fails the build)."""
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (the test extra has it)")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "engines" / "index.html").is_file()


#: what a placeholder in a documented command stands for, to parse it as written
PLACEHOLDERS = {"N": "2", "M": "4", "G": "256", "K": "5", "BW": "1gbit", "P": "2",
                "COMMIT": "10", "ITER": "5"}
SH_BLOCK = re.compile(r"```sh\n(.*?)```", re.S)


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `poseidon`) of every `poseidon` command in a shell block of the README
    and the docs, continuation lines joined, comments and shell wrappers (sudo, srun, mpiexec
    ..., a pipe) left out."""
    import shlex
    out = []
    for doc in DOCS:
        for block in SH_BLOCK.findall(doc.read_text(encoding="utf-8")):
            for line in block.replace("\\\n", " ").splitlines():
                for cut in (" #", " | ", " && ", " > ", " &"):
                    line = line.split(cut, 1)[0]
                line = line.strip()
                if line.startswith("#") or "poseidon " not in line:
                    continue
                args = shlex.split(line[line.index("poseidon ") + len("poseidon "):])
                # a synopsis: [--opt a|b] is the option with its first value
                args = [a.strip("[]").split("|")[0] for a in args]
                where = f"{doc.relative_to(ROOT)}: {line[:80]}"
                out.append((where, [PLACEHOLDERS.get(a, a) for a in args]))
    return out


@pytest.mark.parametrize("where, args", documented_commands(), ids=lambda v: str(v)[:60])
def test_every_documented_command_parses_as_written(where: str, args: list[str]) -> None:
    """Each command of the README and the docs names a command, subcommand and options that
    exist, with values of their types (its files need not exist here)."""
    import click

    from poseidon_cli.main import cli
    group, ctx, rest = cli, None, list(args)
    while isinstance(group, click.Group) and rest:
        ctx = click.Context(group, info_name="poseidon", parent=ctx)
        name, command, rest = group.resolve_command(ctx, rest)
        assert command is not None, f"{where}: no command {name!r}"
        if isinstance(command, click.Group):
            group = command
            continue
        try:
            command.make_context(name, list(rest), parent=ctx)
        except click.UsageError as e:
            raise AssertionError(f"{where}: {e.format_message()}") from None
        return


#: a shell block run as written, in a scratch folder that sees the checkout's models/
RUNNABLE = re.compile(r"<!-- runs as written[^>]*-->\n```sh\n(.*?)```", re.S)


def runnable_blocks() -> list[tuple[str, str]]:
    return [(f"{doc.relative_to(ROOT)} #{i}", block) for doc in DOCS
            for i, block in enumerate(RUNNABLE.findall(doc.read_text(encoding="utf-8")))]


def test_some_blocks_are_marked_runnable() -> None:
    """The marker is matched (a reworded marker would silently run nothing)."""
    assert any(where.startswith("docs/scaling.md") for where, _ in runnable_blocks())


@pytest.mark.parametrize("where, block", runnable_blocks(), ids=lambda v: str(v)[:40])
def test_a_block_marked_runnable_runs_as_written(where: str, block: str, tmp_path) -> None:
    """Each command succeeds, says no error, and each file it writes with `>` holds output:
    `poseidon` is this checkout's CLI, the working directory a scratch folder with models/."""
    import os
    import subprocess
    import sys

    (tmp_path / "models").symlink_to(ROOT / "models")
    script = f'set -eo pipefail\nposeidon() {{ "{sys.executable}" -m poseidon_cli.main "$@"; }}\n'
    done = subprocess.run(["bash", "-c", script + block], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, f"{where}:\n{done.stderr[-2000:]}"
    assert "error" not in done.stderr.lower(), f"{where}:\n{done.stderr[-2000:]}"
    for out in re.findall(r"> (\S+)", block):
        assert (tmp_path / out).stat().st_size > 0, f"{where}: {out} is empty"
    if "simulate" in block:  # the simulator's table ends in its verdict
        assert any(l.startswith("verdict: ") for l in done.stdout.splitlines()), done.stdout
