"""Benchmark: a new user's first run, cold: a fresh clone, a fresh virtualenv, nothing beside it.

    python benchmarks/bench_first_run.py setup DIR [--ref HEAD] [--extra digits,fast]
    python benchmarks/bench_first_run.py run DIR [--command "..."] [--json FILE]

``setup`` clones this repository's commit ``--ref`` into DIR/poseidon (a clone has no
../shared beside it and no compiled-kernel cache), makes DIR/venv and installs the package
with the extras named, and prints how long the install took. ``run`` runs the README's first
command (install excluded) in DIR/poseidon with that venv first on PATH, inside a
pseudo-terminal as a user's shell would (line-buffered output, the progress bar drawn), and
prints every line with its time since the start, the whole wall time, the test accuracy, and
the longest silent gap: the longest time with no byte of output, with the lines before and
after it. The first ``run`` on a DIR is the cold one; for a warm one, run again with
``--command`` the training alone (the data step refuses to overwrite its LMDBs).

Run ``run`` alone on the machine (on a shared one, under the exclusive lock): it is a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the README's first command, install excluded
FIRST_COMMAND = ("poseidon data digits --out models/data/digits && poseidon train "
                 "--solver models/digits_lenet/solver.prototxt -n 2")
ACCURACY = re.compile(r"Test net output #\d+: accuracy = ([0-9.]+)")


def setup(d: Path, ref: str, extras: str) -> None:
    """Clone ``ref`` of this repository into d/poseidon and install it into a fresh d/venv."""
    d.mkdir(parents=True, exist_ok=False)
    subprocess.run(["git", "clone", "-q", "--no-local", str(ROOT), str(d / "poseidon")],
                   check=True)
    subprocess.run(["git", "-C", str(d / "poseidon"), "checkout", "-q", ref], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(d / "venv")], check=True)
    spec = f".[{extras}]" if extras else "."
    t0 = time.perf_counter()
    subprocess.run([str(d / "venv" / "bin" / "pip"), "install", "-q", "-e", spec],
                   cwd=d / "poseidon", check=True)
    print(f"installed {spec} at {ref} in {time.perf_counter() - t0:.1f} s")


def run_in_pty(command: str, cwd: Path, env: dict[str, str]) -> tuple[int, list[tuple[float, str]],
                                                                      list[float]]:
    """Run ``command`` in a pseudo-terminal: (exit code, (time, line) pairs, times of every
    chunk of output). A progress bar's carriage returns end a line too."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the shell running the command
        os.chdir(cwd)
        os.execvpe("bash", ["bash", "-c", command], env)
    t0 = time.perf_counter()
    chunks, lines, partial = [], [], ""
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        now = time.perf_counter() - t0
        chunks.append(now)
        partial += data.decode(errors="replace")
        *done, partial = re.split(r"[\r\n]+", partial)
        lines += [(now, line) for line in done if line.strip()]
    _, status = os.waitpid(pid, 0)
    end = time.perf_counter() - t0
    if partial.strip():
        lines.append((end, partial))
    chunks.append(end)
    return os.waitstatus_to_exitcode(status), lines, chunks


def run(d: Path, command: str, json_out: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV",
                                                                     "NUMBA", "POSEIDON"))}
    env["PATH"] = f"{d / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(d / "venv")
    code, lines, chunks = run_in_pty(command, d / "poseidon", env)
    for t, line in lines:
        print(f"{t:7.2f}  {line[:150]}")
    starts = [0.0, *chunks[:-1]]
    gap, gap_end = max((b - a, b) for a, b in zip(starts, chunks))
    before = [line for t, line in lines if t <= gap_end - gap][-1:] or ["(start)"]
    after = [line for t, line in lines if t >= gap_end][:1] or ["(end)"]
    accuracy = [float(m.group(1)) for _, line in lines if (m := ACCURACY.search(line))]
    result = {"command": command, "exit_code": code, "wall_s": round(chunks[-1], 2),
              "longest_silent_gap_s": round(gap, 2), "gap_after": before[0][:150],
              "gap_before": after[0][:150], "accuracy": accuracy[-1] if accuracy else None,
              "lines": [[round(t, 2), line] for t, line in lines]}
    print(f"exit {code}; wall {result['wall_s']} s; final accuracy {result['accuracy']}; "
          f"longest silent gap {result['longest_silent_gap_s']} s, after: {before[0][:100]!r}, "
          f"until: {after[0][:100]!r}")
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1) + "\n")
    return code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    s = sub.add_parser("setup", help="clone and install into a new folder")
    s.add_argument("dir", type=Path)
    s.add_argument("--ref", default="HEAD", help="the commit to clone")
    s.add_argument("--extra", default="digits,fast", help="the extras to install")
    r = sub.add_parser("run", help="run the first command, cold the first time")
    r.add_argument("dir", type=Path)
    r.add_argument("--command", default=FIRST_COMMAND)
    r.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    if args.step == "setup":
        setup(args.dir, args.ref, args.extra)
    else:
        sys.exit(run(args.dir, args.command, args.json))


if __name__ == "__main__":
    main()
