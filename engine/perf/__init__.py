"""Performance: layer-time traces and `poseidon time`'s measurement, the DAG model of synchronous
SGD (`poseidon simulate`), compute replay, and the benches (`poseidon bench`). A floor above the
trainer: nothing here is needed to train, nothing below imports it (tests/test_architecture.py);
it measures and predicts training."""
