"""`poseidon train --hosts H` / `-n N`: start the local workers and supervise them.

Started without a rank (none given, none in SLURM_PROCID / OMPI_COMM_WORLD_RANK / RANK), the
launcher starts one worker process per local hosts entry (and, with ``--launch ssh``, one per
remote entry over ssh) and supervises them: when any of them fails, every other one is stopped
and the error names it; signals are passed on (see ``launch_all``). With a rank, this process
is that worker (poseidon_cli/launch/worker.py).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

from engine.comm.auth import KEY_ENV, job_key, key_hex, new_key
from engine.comm.errors import CommError
from engine.comm.hosts import HostEntry, is_local, local_addresses, parse_hosts

from .config import JobConfig
from .relay import ErrorRelay

RANK_ENV = ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "RANK")


def rank_from_env(environ: dict[str, str] | None = None) -> int | None:
    env = os.environ if environ is None else environ
    for var in RANK_ENV:
        if env.get(var, "").strip():
            try:
                return int(env[var])
            except ValueError:
                raise CommError(f"{var}={env[var]!r} is not a rank number") from None
    return None


def worker_command(config: JobConfig, rank: int, gpu: int | None) -> list[str]:
    """The command line of worker ``rank``: the job's configuration as JSON, not an argv."""
    cmd = [sys.executable, "-m", "poseidon_cli.launch.worker", "--rank", str(rank)]
    if gpu is not None:
        cmd += ["--gpu", str(gpu)]
    return cmd + ["--config", config.to_json()]


def ssh_command(entry: HostEntry, cmd: Sequence[str]) -> list[str]:
    """Run ``cmd`` on ``entry``'s machine in the same directory (shared file system assumed).
    The job key comes on the first line of its standard input, never on a command line."""
    remote = (f"cd {shlex.quote(os.getcwd())} && IFS= read -r {KEY_ENV} && export {KEY_ENV} "
              f"&& exec {shlex.join(cmd)}")
    return ["ssh", "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", entry.host, remote]


def assign_gpus(entries: list[HostEntry], gpus: Sequence[int] | None) -> dict[int, int | None]:
    """Each rank's GPU: the machine's workers take ``gpus`` round robin, in hosts-file order."""
    if gpus is None:
        return {e.rank: None for e in entries}
    ids = list(gpus)
    seen: dict[str, int] = {}
    out: dict[int, int | None] = {}
    for e in entries:
        i = seen.get(e.host, 0)
        seen[e.host] = i + 1
        out[e.rank] = ids[i % len(ids)]
    return out


def run(config: JobConfig, rank: int | None = None, launch: str = "local") -> None:
    """What `poseidon train --hosts H` does; raises CommError with a one-line message."""
    if launch not in ("local", "ssh"):
        raise CommError(f"--launch must be 'local' or 'ssh', got {launch!r}")
    entries = parse_hosts(config.hosts)
    rank = rank if rank is not None else rank_from_env()
    if rank is None:
        launch_all(config, entries, launch)
        return
    if not 0 <= rank < len(entries):
        raise CommError(f"--rank {rank} out of range: {config.hosts} lists {len(entries)} hosts")
    from .worker import run_worker
    run_worker(config, entries, rank, assign_gpus(entries, config.gpus)[rank])


def launch_all(config: JobConfig, entries: list[HostEntry], launch: str) -> None:
    """Start every local worker (and, with ssh, the remote ones) and supervise them. SIGINT,
    SIGTERM and SIGHUP are passed on to each local worker, which acts on them as the solver's
    signal effects say, at the iteration all workers agree on (engine/comm/syncer.py); a
    second SIGINT or SIGTERM stops every process at once."""
    local = local_addresses()
    procs: dict[str, subprocess.Popen] = {}
    remote = [e for e in entries if not is_local(e, local)]
    if remote and launch != "ssh":
        print(f"poseidon: {len(remote)} hosts are not this machine; start them with "
              f"`poseidon train ... --rank N` there (or use --launch ssh): "
              + ", ".join(f"rank {e.rank} at {e}" for e in remote), file=sys.stderr)
    key = job_key(config.key_file)
    if key is None:
        if remote and launch != "ssh":
            raise CommError(f"{len(remote)} hosts are not this machine and will be started by "
                            "hand: they need this job's key. Make one with `poseidon keygen "
                            "job.key`, copy it to every host and give --key-file job.key to "
                            "every rank")
        key = new_key()  # a fresh key per launch: an earlier run's messages cannot be replayed
    plain_env = {k: v for k, v in os.environ.items() if k != KEY_ENV}  # ssh: the key goes on stdin
    env = {**plain_env, KEY_ENV: key_hex(key)}
    gpu_of = assign_gpus(entries, config.gpus)
    relay = ErrorRelay()
    effects = config.signal_effects
    forwarded: set[int] = set()

    def forward(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if effects.get(name if name != "SIGTERM" else "SIGINT", "") == "none":
            return
        if signum != signal.SIGHUP and signum in forwarded:
            raise KeyboardInterrupt  # asked twice: stop now
        forwarded.add(signum)
        for p in procs.values():
            if p.poll() is None:
                try:
                    os.kill(p.pid, signum)  # the worker alone: it stops its own shard
                except ProcessLookupError:
                    pass

    # set explicitly: a launcher started in the background by a script inherits SIGINT ignored
    handled = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s]
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        for e in entries:
            cmd = worker_command(config, e.rank, gpu_of[e.rank])
            over_ssh = not is_local(e, local)
            if over_ssh:
                if launch != "ssh":
                    continue
                cmd = ssh_command(e, cmd)
            # own session: Ctrl-C reaches the launcher only, which then stops everything
            proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE,
                                    env=plain_env if over_ssh else env,
                                    stdin=subprocess.PIPE if over_ssh else None)
            if over_ssh:
                assert proc.stdin is not None
                proc.stdin.write((key_hex(key) + "\n").encode())
                proc.stdin.close()
            relay.watch(proc)
            procs[f"worker {e.rank} ({e})"] = proc
        if not procs:
            raise CommError(f"{config.hosts}: no entry is this machine; run `poseidon train ... "
                            "--rank N` on each host, or use --launch ssh")
        supervise(procs, relay, config.snapshot)
    except KeyboardInterrupt:
        stop_all(procs)
        raise CommError(f"interrupted twice: stopped all {len(procs)} worker processes at once, "
                        "without a snapshot") from None
    finally:
        stop_all(procs)
        for s, h in previous.items():
            signal.signal(s, h)


def supervise(procs: dict[str, subprocess.Popen], relay: ErrorRelay | None = None,
              resumed_from: str | None = None, poll_s: float = 0.1) -> None:
    """Wait for every process; the first that fails stops the others. The error is the first
    one a process reported (the real cause), else the failing process names itself."""
    running = dict(procs)
    while running:
        for name, p in list(running.items()):
            rc = p.poll()
            if rc is None:
                continue
            del running[name]
            if rc != 0:
                # what was reported up to now is the cause; what the others say once stopped
                # is a consequence
                reported = relay.first_error(p) if relay is not None else None
                if reported is None:
                    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                    last = (relay.last_snapshot if relay is not None else None) or resumed_from
                    reported = (f"{name} {how}; stopped the other {len(running)} workers; "
                                f"last good snapshot: {last or 'none'}")
                stop_all(running)
                raise CommError(reported)
        time.sleep(poll_s)


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGKILL each process group (a worker and its shard). Not SIGTERM: a worker takes that
    as a request to snapshot and stop, which a run that lost a peer cannot do. Snapshots are
    written atomically, so nothing is left half-written."""
    for p in procs.values():
        _signal_group(p, signal.SIGKILL)
        if p.poll() is None:
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the worker leads its group; its shard child is in it
    except (ProcessLookupError, PermissionError):
        pass
