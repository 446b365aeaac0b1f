"""The `poseidon` click group; each command lives in its own module of this package."""
from __future__ import annotations

import importlib
import re
import sys

import click

#: command name -> "module:function"; modules are imported only when their command runs,
#: so `poseidon --help` stays fast and one broken optional dependency does not break all.
COMMANDS = {
    "train": "poseidon_cli.commands.train:train",
    "test": "poseidon_cli.commands.test:test",
    "time": "poseidon_cli.commands.time:time_cmd",
    "convert": "poseidon_cli.commands.convert:convert",
    "data": "poseidon_cli.commands.data:data",
    "device-query": "poseidon_cli.commands.device:device_query",
    "simulate": "poseidon_cli.commands.simulate:simulate",
    "bench": "poseidon_cli.commands.bench:bench",
    "keygen": "poseidon_cli.commands.keygen:keygen",
    "warmup": "poseidon_cli.commands.warmup:warmup",
}


#: Caffe's spellings of commands Poseidon names otherwise
ALIASES = {"device_query": "device-query"}
#: Caffe's gflags style: one dash before a long name (-solver, -sigint_effect=snapshot)
CAFFE_FLAG = re.compile(r"^-([a-z][a-z0-9_]+)(=.*)?$")


def caffe_flags(args: list[str]) -> list[str]:
    """Caffe's single-dash long flags as click's double-dash ones (-gpu 0 -> --gpu 0).

    Single letters (-h, -n) stay short options; negative numbers do not start with a letter.
    """
    out = []
    for a in args:
        m = CAFFE_FLAG.match(a)
        out.append(f"--{m.group(1).replace('_', '-')}{m.group(2) or ''}" if m else a)
    return out


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in COMMANDS if _find(name) is not None)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return _find(ALIASES.get(name, name))

    def main(self, args: list[str] | None = None, *rest: object, **kwargs: object) -> object:
        args = list(sys.argv[1:] if args is None else args)
        # (a reader that stopped reading, `| head`: click ends quietly with exit code 1, as a
        # tool killed by SIGPIPE ends non-zero; user_errors lets that error through to it)
        return super().main(caffe_flags(args), *rest, **kwargs)  # type: ignore[arg-type]


def _find(name: str) -> click.Command | None:
    target = COMMANDS.get(name)
    if target is None:
        return None
    module, attr = target.split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if e.name == module:  # command not built yet
            return None
        raise


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="poseidon", prog_name="poseidon")
def cli() -> None:
    """Poseidon: train Caffe models on many machines."""


# the one-line error of every command (re-exported: scripts and tests import it from here)
from .console import fail, run_process, user_errors  # noqa: E402,F401


def run() -> None:
    """The `poseidon` command: the group, in a process that exits without the teardown."""
    run_process(cli)


if __name__ == "__main__":  # pragma: no cover
    run()
