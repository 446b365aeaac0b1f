"""The benches that measure whole `poseidon train` runs: they start worker processes
(``python -m poseidon_cli.main train ...``), so they live with the command line, above the
engine's performance tools (engine/perf) that they use."""
