"""The worker processes an elastic driver starts: one per slot its listing names, locally or
over ssh, each with its settings (and, over ssh, the job key) on standard input; their exits,
with what each said last (its error line, its newest snapshot: relay.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Callable

from engine.comm.auth import KEY_ENV, key_hex
from engine.comm.hosts import HostEntry, is_local_host

from ...job_config import JobConfig
from ..relay import ErrorRelay
from .sources import Slot


@dataclass
class Child:
    proc: subprocess.Popen
    relay: ErrorRelay
    slot: Slot


def member_command() -> list[str]:
    """The command of a worker the driver starts; its settings come on standard input."""
    return [sys.executable, "-m", "poseidon_cli.launch.elastic.member"]


def exit_reason(rc: int, reported: str | None) -> str:
    how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
    return f"{how} ({reported})" if reported else how


class Children:
    """The processes started for the job's slots, by slot."""

    def __init__(self, config: JobConfig, key: bytes, port: int, launch: str,
                 local: Any, say: Callable[[str], None]) -> None:
        self.config, self.key, self.port, self.launch = config, key, port, launch
        self.local, self.say = local, say
        self.by_slot: dict[tuple[str, int], Child] = {}

    def here(self, slot: Slot) -> bool:
        """Whether the driver starts the worker of ``slot``: on this machine, or over ssh."""
        return is_local_host(slot.host, self.local) or self.launch == "ssh"

    def start(self, slot: Slot) -> None:
        from ..launcher import ssh_command

        gpus = self.config.gpus
        gpu = gpus[slot.local % len(gpus)] if gpus else None
        here = is_local_host(slot.host, self.local)
        driver_host = "127.0.0.1" if here else own_host(slot.host, self.port)
        settings = json.dumps({"config": self.config.to_json(), "driver":
                               f"{driver_host}:{self.port}", "host": slot.host,
                               "port": slot.port, "machine": slot.machine, "gpu": gpu})
        plain = {k: v for k, v in os.environ.items() if k != KEY_ENV}
        if here:
            cmd, env, stdin = member_command(), {**plain, KEY_ENV: key_hex(self.key)}, \
                settings + "\n"
        else:
            entry = HostEntry(0, slot.host, slot.port, 0, 0, 1, slot.where)
            cmd, env = ssh_command(entry, member_command()), plain
            stdin = key_hex(self.key) + "\n" + settings + "\n"
        proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE,
                                stdin=subprocess.PIPE, env=env)
        relay = ErrorRelay()
        relay.watch(proc)
        assert proc.stdin is not None
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:  # it died at once: ``exited`` says how
            pass
        self.by_slot[slot.key] = Child(proc, relay, slot)
        self.say(f"Elastic: started the worker at {slot.host}:{slot.port} ({slot.where}; pid "
                 f"{proc.pid})")

    def kill(self, key: tuple[str, int]) -> None:
        """Stop the process of slot ``key``, where one runs."""
        child = self.by_slot.get(key)
        if child is not None and child.proc.poll() is None:
            kill_group(child.proc)

    def exited(self) -> list[tuple[Child, int, str]]:
        """The processes that ended since last asked: (child, exit code, why, in one line)."""
        out = []
        for key, child in list(self.by_slot.items()):
            rc = child.proc.poll()
            if rc is None:
                continue
            kill_group(child.proc)  # what is left of its process group: its shard
            del self.by_slot[key]
            out.append((child, rc, exit_reason(rc, child.relay.first_error(child.proc,
                                                                           wait_s=0.5))))
        return out

    def newest_snapshot(self) -> str | None:
        found = [c.relay.last_snapshot for c in self.by_slot.values() if c.relay.last_snapshot]
        return found[-1] if found else None

    def end(self, wait_s: float) -> None:
        """Let every process end within ``wait_s`` (they were told to exit), then kill."""
        import time
        deadline = time.monotonic() + wait_s
        for child in self.by_slot.values():
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_group(child.proc)


def own_host(peer: str, port: int) -> str:
    """This machine's address on the route to ``peer``."""
    from ..rendezvous import own_address
    return own_address(peer, port)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
