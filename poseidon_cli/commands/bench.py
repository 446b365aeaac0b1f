"""`poseidon bench`: every benchmark, each measuring its peer in the same run.

Subcommands are loaded when they run, as the top-level commands are (poseidon_cli/main.py).
"""
from __future__ import annotations

import importlib

import click

SUBCOMMANDS = {
    "cluster": "poseidon_cli.benches.cluster_cmd:cluster",
    "comm": "poseidon_cli.benches.comm_cmd:comm",
    "data": "poseidon_cli.benches.data_cmd:data",
    "elastic": "poseidon_cli.benches.elastic_cmd:elastic",
    "shard": "poseidon_cli.benches.shard_cmd:shard",
    "time": "poseidon_cli.benches.time_cmd:time_cmd",
    "train": "poseidon_cli.benches.train_cmd:train",
}


class LazyBench(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group("bench", cls=LazyBench)
def bench() -> None:
    """Measure speed against a peer measured in the same run; print ratios, write JSON."""
