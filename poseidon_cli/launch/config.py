"""One distributed job's settings, handed to each worker process as JSON.

The launcher starts a worker with ``--rank``, its GPU and this object, not with a re-built
`poseidon train` argv parsed a second time; a worker started by hand (SLURM, mpirun) builds the
same object from its own command line. Reading it checks every field's name and type.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from engine.comm.auth import job_key
from engine.comm.codecs import WIRES
from engine.comm.errors import CommError
from engine.comm.planner import split_comm
from engine.comm.schemes.ps import DEFAULT_CHUNK_BYTES
from engine.comm.shard import DEFAULT_THREADS as DEFAULT_SHARD_THREADS

SIGNAL_ACTIONS = ("stop", "snapshot", "none")

NO_KEY = ("no job key: every process of a job authenticates its messages with one key. Make "
          "one with `poseidon keygen job.key`, copy it to every host (mode 600) and give "
          "--key-file job.key to every rank (or set $POSEIDON_JOB_KEY); a launcher that starts "
          "all the workers itself (-n, --hosts with local entries, --launch ssh) makes one")


@dataclass(frozen=True)
class JobConfig:
    solver: str
    #: where the host table came from (a hosts file, "-H ...", "-n N", a manager), for messages
    hosts: str
    comm: str = "auto"
    timeout: float = 30.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: summing threads of each PS shard (0: on its receive thread, engine/comm/shard.py)
    shard_threads: int = DEFAULT_SHARD_THREADS
    #: the gradients' encoding on the wire (engine/comm/codecs)
    wire: str = "fp32"
    #: coarse-grained sparse communication: the fraction of chunks sent per round (0: dense)
    sparse: float = 0.0
    #: with sparse: the first rounds that send everything
    sparse_warmup: int = 0
    #: with sparse: the codec keeps SGD's momentum (DGC's momentum correction)
    momentum_correction: bool = True
    #: fusion buckets: at most this many MB, nor a first layer waiting longer than fusion_ms
    fusion_mb: float = 4.0
    fusion_ms: float = 5.0
    #: the link to plan for ("10gbit@50us" or a poseidon-link file); None: probe at start-up
    link: str | None = None
    #: a plan file (or a solverstate) whose plan this run follows instead of planning its own
    plan: str | None = None
    #: send the lowest waiting layer first (the next forward needs it first)
    priority: bool = True
    #: reduce inside each machine first (two levels) when machines run several workers
    levels: bool = True
    weights: tuple[str, ...] = ()
    snapshot: str | None = None
    #: the GPUs each machine's workers take round robin (None: the CPU)
    gpus: tuple[int, ...] | None = None
    #: --gpus: local worker i of every machine takes gpus[i] (one worker per GPU)
    pin_gpus: bool = False
    stats: str | None = None
    #: SIGINT / SIGTERM / SIGHUP -> stop | snapshot | none (Caffe's -sigint_effect...)
    signal_effects: dict[str, str] = field(default_factory=dict)
    replay: str | None = None
    time_scale: float = 1.0
    timeline: str | None = None
    #: each worker also writes its whole log, whatever its rank, to <log_dir>/rank<N>.log
    log_dir: str | None = None
    #: the job key's file (the key itself never travels in this object: it is on command lines)
    key_file: str | None = None

    def __post_init__(self) -> None:
        try:
            split_comm(self.comm)
        except ValueError as e:
            raise CommError(str(e)) from None
        if self.wire not in WIRES:
            raise CommError(f"--wire must be one of {', '.join(WIRES)}, got {self.wire!r}")
        if not 0 <= self.sparse < 1:
            raise CommError(f"--sparse must be a fraction between 0 and 1, got {self.sparse:g}")
        if self.sparse and self.wire != "fp32":
            raise CommError("--sparse sends float32 values: give it without --wire fp16")
        if self.sparse_warmup < 0 or (self.sparse_warmup and not self.sparse):
            raise CommError(f"--sparse-warmup {self.sparse_warmup}: the dense rounds before "
                            "--sparse starts, >= 0 and only with --sparse")
        if not (self.fusion_mb >= 0 and self.fusion_ms >= 0):
            raise CommError(f"--fusion-mb and --fusion-ms must be >= 0, got {self.fusion_mb:g} "
                            f"and {self.fusion_ms:g}")
        if not self.timeout > 0:
            raise CommError(f"--timeout must be positive, got {self.timeout:g}")
        if self.chunk_bytes < 1:
            raise CommError(f"--chunk-bytes must be positive, got {self.chunk_bytes}")
        if self.shard_threads < 0:
            raise CommError(f"--shard-threads must be >= 0, got {self.shard_threads}")
        for sig, action in self.signal_effects.items():
            if sig not in ("SIGINT", "SIGTERM", "SIGHUP") or action not in SIGNAL_ACTIONS:
                raise CommError(f"signal effect {sig}={action!r}: expected SIGINT, SIGTERM or "
                                f"SIGHUP = {' | '.join(SIGNAL_ACTIONS)}")

    @property
    def codec(self) -> str:
        """The plan's codec (engine/comm/codecs)."""
        return "sparse" if self.sparse else self.wire

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "JobConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CommError(f"job configuration: not JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise CommError("job configuration: not a JSON object")
        kinds = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - set(kinds))
        if unknown:
            raise CommError(f"job configuration: unknown field(s) {', '.join(unknown)}")
        for name in ("solver", "hosts"):
            if name not in d:
                raise CommError(f"job configuration: no {name!r}")
        for name, value in d.items():
            _check(name, value)
        d["weights"] = tuple(d.get("weights", ()))
        if d.get("gpus") is not None:
            d["gpus"] = tuple(d["gpus"])
        return cls(**d)


_STR = ("solver", "hosts", "comm", "wire")
_OPT_STR = ("snapshot", "stats", "replay", "timeline", "log_dir", "key_file", "link", "plan")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(name: str, value: Any) -> None:
    ok = {
        "timeout": _number(value),
        "time_scale": _number(value),
        "fusion_mb": _number(value),
        "fusion_ms": _number(value),
        "sparse": _number(value),
        "sparse_warmup": isinstance(value, int) and not isinstance(value, bool),
        "momentum_correction": isinstance(value, bool),
        "priority": isinstance(value, bool),
        "levels": isinstance(value, bool),
        "pin_gpus": isinstance(value, bool),
        "chunk_bytes": isinstance(value, int) and not isinstance(value, bool),
        "shard_threads": isinstance(value, int) and not isinstance(value, bool),
        "weights": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "gpus": value is None or (isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)),
        "signal_effects": isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
    }.get(name)
    if ok is None:
        ok = isinstance(value, str) if name in _STR else (
            value is None or isinstance(value, str)) if name in _OPT_STR else True
    if not ok:
        raise CommError(f"job configuration: field {name!r} has the wrong type: {value!r}")


def require_key(config: JobConfig) -> bytes:
    """The job key (--key-file, else $POSEIDON_JOB_KEY); a CommError saying how to make one."""
    key = job_key(config.key_file)
    if key is None:
        raise CommError(NO_KEY)
    return key
