"""One distributed job's settings, handed to each worker process as JSON.

The launcher starts a worker with ``--rank``, its GPU and this object, not with a re-built
`poseidon train` argv parsed a second time; a worker started by hand (SLURM, mpirun) builds the
same object from its own command line. Reading it checks every field's name and type.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import click

from engine.comm.auth import job_key
from engine.comm.codecs import WIRES
from engine.comm.errors import CommError
from engine.comm.planner import COMM_MODES, split_comm
from engine.comm.schemes import ENGINE_SCHEMES, SCHEMES
from engine.comm.chunks import DEFAULT_CHUNK_BYTES
from engine.comm.shard import DEFAULT_THREADS as DEFAULT_SHARD_THREADS

from engine.kernels.cudnn_conv import DEFAULT_MATH, MATHS

from .options import GPU_MATH

SIGNAL_ACTIONS = ("stop", "snapshot", "none")

NO_KEY = ("no job key: every process of a job authenticates its messages with one key. Make "
          "one with `poseidon keygen job.key`, copy it to every host (mode 600) and give "
          "--key-file job.key to every rank (or set $POSEIDON_JOB_KEY); a launcher that starts "
          "all the workers itself (-n, --hosts with local entries, --launch ssh) makes one")


def option(default: Any, *decls: str, **click_kwargs: Any) -> Any:
    """A JobConfig field that `poseidon train` takes as the click option ``decls`` (declared
    here once: commands/train.py adds every such option, and its value lands in this field)."""
    return field(default=default, metadata={"option": (decls, click_kwargs)})


@dataclass(frozen=True)
class JobConfig:
    """One training job's settings, single-process or distributed (``hosts`` says where the
    host table came from; "" for one process)."""

    solver: str
    #: where the host table came from (a hosts file, "-H ...", "-n N", a manager), for messages
    hosts: str = ""
    comm: str = option(
        "auto", "--comm", show_default=True, metavar="MODE[,LAYER=SCHEME...]",
        help=f"Gradient communication per layer ({'|'.join(COMM_MODES)}): the fastest of the "
        "schemes by the cost model (auto), Poseidon's PS/SFB choice by bytes (hybrid), or one "
        "scheme wherever the layer allows it; then layers given a scheme by name (ip1=sfb). "
        f"{', '.join(ENGINE_SCHEMES)}: the collective engine of that name, whose traffic is "
        "not authenticated.")
    trusted_network: bool = option(
        False, "--trusted-network", is_flag=True,
        help=f"The workers' network admits no outsider: --comm auto may also plan the "
        f"collective engines ({', '.join(ENGINE_SCHEMES)}), which authenticate nothing "
        "(the plan, signals and elastic control stay authenticated).")
    timeout: float = option(30.0, "--timeout", show_default=True,
                            help="Seconds before a peer that went silent is declared lost.")
    startup_timeout: float = option(
        120.0, "--startup-timeout", show_default=True,
        help="Seconds every process of the job has to come at start-up (workers started by "
        "hand on other machines included; each waiting process says whom it waits for every "
        "few seconds); after that, --timeout bounds a peer's silence.")
    chunk_bytes: int = option(DEFAULT_CHUNK_BYTES, "--chunk-bytes", show_default=True,
                              help="Largest piece of a parameter one PS shard holds.")
    shard_threads: int = option(
        DEFAULT_SHARD_THREADS, "--shard-threads", type=click.IntRange(min=0), show_default=True,
        help="Threads each PS shard sums its chunks on (chunks pinned to them, summed in "
        "place); 0: on its receive thread, as before.")
    wire: str = option("fp32", "--wire", type=click.Choice(WIRES), show_default=True,
                       help="Gradients on the wire: float32, or float16 (half the bytes; sums "
                       "in float32; an overflow skips that layer's update and halves its "
                       "scale). Sparse communication is --sparse.")
    #: coarse-grained sparse communication: the fraction of chunks sent per round (0: dense)
    sparse: float = 0.0
    #: with sparse: the first rounds that send everything
    sparse_warmup: int = 0
    #: with sparse: the codec keeps SGD's momentum (DGC's momentum correction)
    momentum_correction: bool = True
    fusion_mb: float = option(
        4.0, "--fusion-mb", type=click.FloatRange(min=0), show_default=True,
        help="Fuse consecutive small PS / ring layers into buckets of at most this many MB "
        "(0: no fusion; 4 measured best, see the README).")
    fusion_ms: float = option(
        5.0, "--fusion-ms", type=click.FloatRange(min=0), show_default=True,
        help="A bucket's first layer waits at most this long (estimated) for its last.")
    link: str | None = option(
        None, "--link", metavar="BW[@LATENCY]|FILE",
        help="Plan for this link (10gbit@50us, or a `poseidon bench comm --link-out` file) "
        "instead of probing it at start-up.")
    plan: str | None = option(
        None, "--plan", type=click.Path(dir_okay=False),
        help="Follow this communication plan (a run's <snapshot_prefix>_plan.prototxt, or a "
        ".solverstate) instead of planning from the link probe: two runs with one plan sum in "
        "the same order, bit for bit. A resumed run follows its snapshot's plan unless the "
        "workers differ.")
    priority: bool = option(
        True, "--priority/--no-priority", show_default=True,
        help="When several layers wait to be sent, send the lowest (the next forward needs it "
        "first).")
    levels: bool = option(
        True, "--levels/--no-levels", show_default=True,
        help="With several workers per machine, reduce inside each machine first and send one "
        "copy per machine (--no-levels: every worker a node of its own).")
    verbose: bool = option(
        False, "-v", "--verbose", is_flag=True,
        help="With workers: print the plan's whole table at start-up and the communication "
        "counters of every layer at each display (they are always in --stats).")
    #: fine-tune from these weights files, in order
    weights: tuple[str, ...] = ()
    snapshot: str | None = option(None, "--snapshot", type=click.Path(dir_okay=False),
                                  help="Resume from this .solverstate (or .solverstate.h5).")
    level: int | None = option(
        None, "--level", type=int,
        help="The train net's NetState level (Caffe's -level; default: the solver's "
        "train_state).")
    stage: tuple[str, ...] = option(
        (), "--stage", multiple=True, metavar="STAGE[,STAGE...]",
        help="NetState stages of the train net, added to the solver's train_state (Caffe's "
        "-stage; repeat, or separate by commas).")
    #: the GPUs each machine's workers take round robin (None: the CPU)
    gpus: tuple[int, ...] | None = None
    #: --gpus: local worker i of every machine takes gpus[i] (one worker per GPU)
    pin_gpus: bool = False
    gpu_math: str = option(DEFAULT_MATH, "--gpu-math", **GPU_MATH)
    stats: str | None = option(None, "--stats", type=click.Path(dir_okay=False),
                               help="Write communication counters as JSON here.")
    #: SIGINT / SIGTERM / SIGHUP -> stop | snapshot | none (Caffe's -sigint_effect...)
    signal_effects: dict[str, str] = field(default_factory=dict)
    replay: str | None = option(
        None, "--replay", type=click.Path(dir_okay=False),
        help="Replace each layer's compute by waiting its time in this trace (a "
        "poseidon-layer-trace or `poseidon time --json`); all else is real.")
    time_scale: float = option(1.0, "--time-scale", show_default=True,
                               help="With --replay: multiply every traced time by this.")
    timeline: str | None = option(
        None, "--timeline", type=click.Path(dir_okay=False),
        help="Write Chrome trace events (Perfetto): layers, sends, sums, updates, per process "
        "and thread, merged across the ranks of this machine.")
    log_dir: str | None = option(
        None, "--log-dir", type=click.Path(file_okay=False),
        help="With --hosts or -n: each worker also writes its whole log (every rank's, not "
        "only rank 0's) to DIR/rank<N>.log.")
    key_file: str | None = option(
        None, "--key-file", type=click.Path(dir_okay=False),
        help="The job key every process authenticates its messages with (`poseidon keygen`; "
        "mode 600). Without it the launcher makes a fresh one for the workers it starts; "
        "workers started by hand (--rank) need it, or $POSEIDON_JOB_KEY.")

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
        _, required = self.engines
        if required and self.codec != "fp32":
            flag = "--sparse" if self.sparse else f"--wire {self.wire}"
            raise CommError(f"--comm {required[0]} sums float32 gradients on the engine: give "
                            f"it without {flag}")
        if self.sparse_warmup < 0 or (self.sparse_warmup and not self.sparse):
            raise CommError(f"--sparse-warmup {self.sparse_warmup}: the dense rounds before "
                            "--sparse starts, >= 0 and only with --sparse")
        if not (self.fusion_mb >= 0 and self.fusion_ms >= 0):
            raise CommError(f"--fusion-mb and --fusion-ms must be >= 0, got {self.fusion_mb:g} "
                            f"and {self.fusion_ms:g}")
        if not self.timeout > 0:
            raise CommError(f"--timeout must be positive, got {self.timeout:g}")
        if not self.startup_timeout > 0:
            raise CommError(f"--startup-timeout must be positive, got {self.startup_timeout:g}")
        if self.chunk_bytes < 1:
            raise CommError(f"--chunk-bytes must be positive, got {self.chunk_bytes}")
        if self.shard_threads < 0:
            raise CommError(f"--shard-threads must be >= 0, got {self.shard_threads}")
        if self.gpu_math not in MATHS:
            raise CommError(f"--gpu-math must be one of {', '.join(MATHS)}, got "
                            f"{self.gpu_math!r}")
        if self.gpus is not None and any(g < 0 for g in self.gpus):  # (--gpu checks its own)
            raise CommError(f"job configuration: field 'gpus' has the wrong type: "
                            f"{list(self.gpus)} (device ids are 0 or more)")
        for sig, action in self.signal_effects.items():
            if sig not in ("SIGINT", "SIGTERM", "SIGHUP") or action not in SIGNAL_ACTIONS:
                raise CommError(f"signal effect {sig}={action!r}: expected SIGINT, SIGTERM or "
                                f"SIGHUP = {' | '.join(SIGNAL_ACTIONS)}")

    @property
    def engines(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the collective engines this job may plan, those --comm names): an engine is
        planned only where the user named it or trusts the network (auto, fp32 wire)."""
        mode, overrides = split_comm(self.comm)
        named = [s for s in (mode, *overrides.values()) if s in ENGINE_SCHEMES]
        required = tuple(dict.fromkeys(named))
        trusted = mode == "auto" and self.trusted_network and self.codec == "fp32"
        return (tuple(ENGINE_SCHEMES) if trusted else required), required

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
        hints = typing.get_type_hints(cls)
        unknown = sorted(set(d) - set(hints))
        if unknown:
            raise CommError(f"job configuration: unknown field(s) {', '.join(unknown)}")
        for name in ("solver", "hosts"):
            if name not in d:
                raise CommError(f"job configuration: no {name!r}")
        for name, value in d.items():
            if not _fits(value, hints[name]):
                raise CommError(f"job configuration: field {name!r} has the wrong type: "
                                f"{value!r}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's type (JSON has lists where the field has tuples,
    and no difference between 1 and 1.0)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:  # tuple[X, ...]
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1])
                                               for k, v in value.items())
    raise TypeError(f"JobConfig has a field of a type JSON cannot check: {hint}")


def cli_options() -> list[tuple[str, tuple[str, ...], dict[str, Any], Any]]:
    """(field, option declarations, click's keywords, default) of every field `poseidon
    train` takes as an option of the same meaning."""
    return [(f.name, *f.metadata["option"], f.default)
            for f in dataclasses.fields(JobConfig) if "option" in f.metadata]


def check_engines(config: JobConfig, elastic: bool, on_gpu: bool) -> None:
    """Before any process starts: a CommError in one line when the engine --comm names cannot
    run here (not installed; MPI in an elastic job, or not started by an MPI launcher)."""
    for name in config.engines[1]:
        scheme = SCHEMES[name]
        if elastic and not scheme.elastic:  # type: ignore[attr-defined]
            raise CommError(f"--comm {name}: MPI's world is fixed when its launcher starts the "
                            "job, and an elastic job changes its workers: give --comm gloo "
                            "(or auto) with --elastic")
        why = scheme.backend.missing(on_gpu)  # type: ignore[attr-defined]
        if why:
            raise CommError(f"--comm {name}: {why}")


def require_key(config: JobConfig) -> bytes:
    """The job key (--key-file, else $POSEIDON_JOB_KEY); a CommError saying how to make one."""
    key = job_key(config.key_file)
    if key is None:
        raise CommError(NO_KEY)
    return key
