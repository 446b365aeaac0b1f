"""The communicator: everything that talks (DESIGN.md, "The communicator").

hosts (hosts files) -> transport (ZeroMQ endpoint, validated messages, liveness) -> ps (chunk
table, shard server) and syncer (DWBP: PS pushes and SFB factor broadcasts per layer) ->
planner (SACP: PS or SFB per layer by cost) -> stats (counters) -> bind (a Net's layers as
arrays to synchronise). Starting and supervising the processes that use it is not
communication: that is poseidon_cli/launch. engine.comm never imports a layer module.
"""
