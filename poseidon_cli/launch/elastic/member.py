"""A worker of an elastic job: one process that trains in generation after generation.

The driver starts it as ``python -m poseidon_cli.launch.elastic.member`` with its settings as
one line of JSON on standard input (the job key in $POSEIDON_JOB_KEY, or, over ssh, on the
line before); a worker started by hand or by a cluster manager (`poseidon train --elastic
--rendezvous HOST:PORT`) runs ``run_member`` in the CLI's process.

It joins the driver and waits for orders. For each generation it is given, it builds its
Solver afresh with RunContext(rank, P) (its share of the data, its random streams), takes the
state the generation starts from (the driver's commit from its own memory, or, joining, from
the new rank 0 over the generation's endpoint; the first generation starts as any run does:
fresh, --weights or --snapshot), starts its shard and endpoint on its ports under the
generation's key, meets the others, plans (rank 0) and trains. The generation ends at a
regroup or a leave (every worker at one boundary), or fails (a worker lost: what it did
since its newest commit is dropped); either way it reports the commits it holds and waits for
the next. SIGTERM is its manager's notice: it leaves at the next boundary everyone agrees on.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import sys
from pathlib import Path
from typing import Any

from engine.comm.errors import CommError

from ...console import run_process, user_errors
from ...signals import signal_requests
from ...job_config import JobConfig, require_key
from ..shard import ShardStarter
from .boundary import Commits, ElasticSync
from .client import DriverClient
from .protocol import generation_key


class Member:
    """The worker's state across generations."""

    def __init__(self, config: JobConfig, client: DriverClient, key: bytes, gpu: int | None,
                 host: str, port: int, machine: str) -> None:
        self.config, self.client, self.key, self.gpu = config, client, key, gpu
        self.host, self.port, self.machine = host, port, machine
        self.commits = Commits()
        self.solver: Any = None
        self.sync: ElasticSync | None = None
        self.leaving = False
        #: each generation's shard is started during the one before
        self.shards = ShardStarter()
        #: signals that came between generations, for the next one
        self._pending: list[str] = []
        self._plan = "?"
        #: this worker's rank in its newest generation
        self.rank: int | None = None

    # --------------------------------------------------------------- signals (main thread)
    def request(self, action: str) -> None:
        """A signal's action (signals.py calls it): 'leave' (SIGTERM), 'stop', 'snapshot'."""
        if action == "leave":
            self.leaving = True
        if self.sync is None:
            self._pending.append(action)
        elif action == "leave":
            self.sync.request("leave")
        else:
            self.solver.request(action)

    # --------------------------------------------------------------- the loop
    def serve(self) -> None:
        """Train the generations the driver gives until it says exit. When the driver is
        lost, the job stops; the last generation's rank 0 writes the newest commit first."""
        try:
            self._serve()
        except CommError as e:
            if self.client.error is None or self.rank != 0 or self.commits.newest() is None:
                raise
            newest = self.commits.newest()
            assert newest is not None
            written = self.write(newest.iter)
            raise CommError(f"{e}; the last commit (iteration {newest.iter}) " + (
                f"is written to {written['path']}" if written["path"] else
                f"could not be written: {written['reason']}")) from None

    def _serve(self) -> None:
        self.client.join(self.host, self.port, self.machine)
        status, gen, reached, reason = "new", 0, 0, ""
        while True:
            if self.leaving:
                status = "left"
            self.client.tell("report", gen=gen, status=status, commits=self.commits.iterations(),
                             iter=reached, reason=reason[:2000])
            if status == "left":
                # closing before the driver's exit order came would let it see the connection
                # close first and count this graceful leave as a lost worker (and back it off)
                try:
                    self._until_exit()
                except CommError:
                    pass  # the driver is gone: nobody is left to tell
                return
            order = self.next_order()
            if order["kind"] == "exit":
                return
            gen = order["gen"]
            status, reached, reason = self.generation(order)
            if status == "finished":
                self.client.tell("finished", gen=gen, iter=reached)
                self._until_exit()
                return

    def _until_exit(self) -> None:
        """Carry out the driver's orders until it says exit (it has taken this worker's last
        report by then)."""
        while self.next_order()["kind"] != "exit":
            pass

    def next_order(self) -> dict[str, Any]:
        """The driver's next assignment or exit; a write order is carried out on the way."""
        while True:
            order = self.client.next_order()
            if order["kind"] != "write":
                return order
            self.client.tell("wrote", **self.write(order["commit"]))

    def write(self, iteration: int) -> dict[str, str]:
        from engine import glog
        from engine.solvers import SolverError

        glog.set_enabled(True)
        try:
            path = self.solver.write_commit(self.commits.get(iteration))
        except (SolverError, KeyError, OSError) as e:
            return {"path": "", "reason": str(e) or f"no commit of iteration {iteration} here"}
        return {"path": str(path), "reason": ""}

    # --------------------------------------------------------------- one generation
    def generation(self, order: dict[str, Any]) -> tuple[str, int, str]:
        """Train generation ``order``; (how it ended: finished, ended, left or failed; the
        iteration reached; why it failed)."""
        from engine import glog
        from engine.context import RunContext

        from ...training import build_solver
        from ..worker import communicator

        gen, rank, entries = order["gen"], order["rank"], order["hosts"]
        self.rank = rank
        glog.set_enabled(rank == 0)
        first = order["source"] == "start"
        config = dataclasses.replace(self.config, weights=self.config.weights if first else (),
                                     snapshot=self.config.snapshot if first else None)
        solver = self.solver = None  # the last generation's: its memory goes first
        gc.collect()
        try:
            # the solver and its nets print themselves once: the first generation's
            glog.set_enabled(rank == 0 and gen == 1)
            solver = self.solver = build_solver(config, RunContext(rank=rank,
                                                                   world_size=len(entries)))
            glog.set_enabled(rank == 0)
            if gen > 1:
                glog.info(f"Generation {gen}: the solver and its nets built again for "
                          f"{len(entries)} workers (as generation 1 printed them)")
            solver.param.iter_size = order["iter_size"]
            solver.param.base_lr *= order["lr_scale"]
            if first:
                for w in config.weights:
                    solver.load_weights(w)
                if config.snapshot is not None:
                    glog.info(f"Restoring previous solver status from {config.snapshot}")
                    solver.restore(config.snapshot)
            elif order["source"] == "memory":
                solver.restore_commit(self.commits.get(order["commit"]))
            with communicator(config, entries, rank, self.gpu,
                              generation_key(self.key, gen), solver, exit_grace=None,
                              on_endpoint=lambda ep: self.client.watch(gen, ep),
                              wrap_sync=lambda ep, sync: self._wrap(ep, sync, order),
                              shards=self.shards):
                self.client.tell("started", gen=gen, plan=self._plan if rank == 0 else "")
                self.shards.prepare()  # the next generation's
                for action in self._pending:
                    self.request(action)
                self._pending = []
                solver.solve()
            ended = self.sync.ended if self.sync is not None else None
        except CommError as e:
            glog.set_enabled(rank == 0)
            glog.info(f"Generation {gen} ended here: {e}. The elastic driver goes on from "
                      "the newest commit every survivor holds: nothing to do by hand")
            reached = (self.sync.iterations_done() if self.sync is not None else
                       solver.iter if solver is not None else 0)
            return "failed", reached, str(e)
        finally:
            self.sync = None
            self.client.unwatch()
            if solver is not None:
                solver.close()
        if ended is None:
            return "finished", solver.iter, ""
        return ("left" if ended == "leave" and self.leaving else "ended"), solver.iter, ""

    def _wrap(self, ep: Any, sync: Any, order: dict[str, Any]) -> ElasticSync:
        """After the generation's handshake: the state the joiners lack comes from rank 0;
        every worker holds the commit it starts from; the boundary logic wraps the syncer."""
        from engine.comm.handover import receive_commit, send_commit
        from engine.comm.transport import WORKER
        from engine.snapshots import Commit

        solver, chunk = self.solver, self.config.chunk_bytes
        start = order["commit"]
        if order["rank"] == 0:
            self._plan = plan_summary(sync.plan)
            if order["joiners"]:  # rank 0 is a survivor: it holds the commit (immutable
                held = self.commits.get(start)  # copies: the frames may leave zero-copy)
                send_commit(ep, [(WORKER, r) for r in order["joiners"]], held.arrays,
                            held.iter, held.current_step, held.data_positions, chunk)
        if order["source"] == "peer":
            live = solver.state_arrays()
            got = receive_commit(ep, live, start, len(solver.net.data_layers), chunk)
            commit = Commit(start, got.current_step, got.data_positions, b"", got.arrays,
                            len(live) - len(solver.history))
            solver.restore_commit(commit)
        elif order["source"] == "memory":
            commit = self.commits.get(start)
        else:
            commit = solver.commit()
        commit.sync_state = sync.state()  # the plan this generation follows
        self.commits.restart(commit)
        if order["rank"] == 0 and order["source"] != "start":
            self._keep_snapshot(commit)
        self.sync = ElasticSync(sync, solver, self.commits, self.client, order["gen"],
                                solver.iter, order["commit_every"])
        return self.sync


    def _keep_snapshot(self, commit: Any) -> None:
        """Write the snapshot the solver's schedule wanted at the commit this generation
        starts from, where it is missing: a rank 0 commits at a boundary, then writes, and a
        kill in between lost it."""
        solver = self.solver
        every = solver.param.snapshot
        if every and commit.iter and commit.iter % every == 0 \
                and not Path(solver.snapshot_paths()[1]).exists():
            solver.write_commit(commit)


def plan_summary(plan: Any) -> str:
    """A poseidon.Plan in one line: each unit's layers and scheme."""
    units = [f"{'+'.join(u.names) or '+'.join(map(str, u.layers))} {u.scheme}"
             for u in plan.units[:8]]
    more = len(plan.units) - 8
    return "; ".join(units) + (f"; and {more} more units" if more > 0 else "")


def run_member(config: JobConfig, driver: str, host: str, port: int, machine: str,
               gpu: int | None) -> None:
    """Be a worker of the elastic job whose driver listens at ``driver`` (host:port), at
    ``host``:``port`` on ``machine``, training on ``gpu`` (None: the CPU)."""
    from engine import backend, glog

    key = require_key(config)
    if config.log_dir is not None:
        Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        glog.add_file(str(Path(config.log_dir) / f"{host}_{port}.log"))
    glog.set_enabled(False)  # rank 0 of each generation logs, as in any run
    if gpu is not None:
        backend.use_gpu(gpu, config.gpu_math)
    client = DriverClient(driver, key, config.timeout)
    member = Member(config, client, key, gpu, host, port, machine)
    try:
        with signal_requests(member, {**config.signal_effects, "SIGTERM": "leave"}):
            member.serve()
    finally:
        member.shards.close()
        client.close()


_SETTINGS = {"config": str, "driver": str, "host": str, "port": int, "machine": str}


def main() -> None:
    with user_errors():
        try:
            d = json.loads(sys.stdin.readline())
        except (ValueError, UnicodeDecodeError):
            raise CommError("elastic worker: its settings on standard input are not JSON") \
                from None
        if not isinstance(d, dict) or set(d) != {*_SETTINGS, "gpu"} or not all(
                isinstance(d[k], t) for k, t in _SETTINGS.items()) or not (
                d["gpu"] is None or isinstance(d["gpu"], int)):
            raise CommError("elastic worker: its settings on standard input lack a field or "
                            "have one of the wrong type")
        run_member(JobConfig.from_json(d["config"]), d["driver"], d["host"], d["port"],
                   d["machine"], d["gpu"])


if __name__ == "__main__":
    run_process(main)
