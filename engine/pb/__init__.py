"""The protobuf modules generated from caffe.proto and poseidon.proto (generate.py writes them)."""
