"""Performance: layer-time traces, the link model, the DAG model of synchronous SGD
(`poseidon simulate`), compute replay, the timeline, and the emulated cluster (`poseidon bench
cluster`). Nothing here is needed to train; it measures and predicts training."""
