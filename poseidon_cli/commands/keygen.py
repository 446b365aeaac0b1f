"""`poseidon keygen FILE`: a new job key, for workers started by hand on several machines."""
from __future__ import annotations

import click

from ..console import user_errors


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Replace an existing file.")
def keygen(path: str, force: bool) -> None:
    """Write a new random job key to PATH (mode 600). Copy it to every host of the job and
    give `--key-file PATH` to every `poseidon train --rank N`; the job's messages are then
    authenticated with it, and nobody without it can change or stop the job."""
    from engine.comm.auth import write_key_file

    with user_errors():
        write_key_file(path, force=force)
    click.echo(f"wrote a new job key to {path} (mode 600)")
