"""Poseidon's command line: `poseidon train | test | time | bench | simulate | convert | data`."""
