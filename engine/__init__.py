"""Poseidon's compute engine: Caffe formats, layers, nets, solvers, data and the communicator."""
