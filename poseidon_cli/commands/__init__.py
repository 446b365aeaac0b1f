"""The commands of `poseidon`, one module each (main.py loads a command when it runs); the
`bench` subcommands live with their benchmarks in poseidon_cli/benches/. No command imports
another: what two share lives beside this folder (options.py, warming.py, console.py).
"""
