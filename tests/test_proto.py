"""The Caffe schema: the committed module is what proto/caffe.proto generates, and its numbers,
defaults and enums are BVLC Caffe's (spot checks against caffe.proto of Caffe 1.0)."""
from __future__ import annotations

import importlib.util
import re

import pytest

from engine.pb import caffe_pb2


def number(message: type, field: str) -> int:
    return message.DESCRIPTOR.fields_by_name[field].number


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None,
                    reason="needs grpcio-tools to run protoc")
def test_committed_module_is_generated_from_the_proto() -> None:
    from engine.pb import generate

    caffe_proto = generate.PROTO_DIR / "caffe.proto"
    assert caffe_proto in generate.protos()
    # Another grpcio-tools release stamps another version; the schema must still be identical.
    assert generate.check([caffe_proto], ignore_version_stamp=True) == []


def test_generate_check_detects_a_stale_module(tmp_path, monkeypatch) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("needs grpcio-tools")
    from engine.pb import generate

    stale = tmp_path / "caffe_pb2.py"
    stale.write_text("# not generated\n")
    monkeypatch.setattr(generate, "OUT_DIR", tmp_path)
    monkeypatch.setattr(generate, "protos", lambda: [generate.PROTO_DIR / "caffe.proto"])
    diffs = generate.check()
    assert len(diffs) == 1 and "# not generated" in diffs[0]
    # A real schema change is caught even when version stamps are ignored.
    good = generate.generate_text(generate.PROTO_DIR / "caffe.proto")
    stale.write_text(good.replace("shared_file_system", "shared_file_systen"))
    assert len(generate.check(ignore_version_stamp=True)) == 1
    stale.write_text(re.sub(r"Version: \S+", "Version: 1.2.3", good))
    assert generate.check(ignore_version_stamp=True) == [] and len(generate.check()) == 1
    assert generate.main(["--check"]) == 1


@pytest.mark.parametrize("message,field,num", [
    ("LayerParameter", "convolution_param", 106),
    ("LayerParameter", "inner_product_param", 117),
    ("LayerParameter", "transform_param", 100),
    ("LayerParameter", "loss_param", 101),
    ("LayerParameter", "batch_norm_param", 139),
    ("LayerParameter", "input_param", 143),
    ("LayerParameter", "recurrent_param", 146),
    ("LayerParameter", "propagate_down", 11),
    ("LayerParameter", "phase", 10),
    ("NetParameter", "layer", 100),
    ("NetParameter", "layers", 2),
    ("NetParameter", "input_dim", 4),
    ("SolverParameter", "base_lr", 5),
    ("SolverParameter", "type", 40),
    ("SolverParameter", "solver_type", 30),
    ("SolverParameter", "snapshot_format", 37),
    ("SolverParameter", "test_state", 27),
    ("SolverParameter", "train_state", 26),
    ("SolverParameter", "iter_size", 36),
    ("SolverParameter", "random_seed", 20),
    ("SolverState", "history", 3),
    ("SolverState", "current_step", 4),
    ("V1LayerParameter", "blobs_lr", 7),
    ("V1LayerParameter", "weight_decay", 8),
    ("V1LayerParameter", "param", 1001),
    ("V1LayerParameter", "blob_share_mode", 1002),
    ("V1LayerParameter", "transform_param", 36),
    ("V1LayerParameter", "layer", 1),
    ("V0LayerParameter", "hdf5_output_param", 1001),
    ("V0LayerParameter", "k", 22),
    ("BlobProto", "shape", 7),
    ("BlobProto", "double_data", 8),
    ("ConvolutionParameter", "dilation", 18),
    ("ConvolutionParameter", "stride", 6),
    ("PoolingParameter", "global_pooling", 12),
    ("DataParameter", "backend", 8),
    ("DataParameter", "prefetch", 10),
    ("ParamSpec", "decay_mult", 4),
    ("NetStateRule", "not_stage", 5),
    ("Datum", "encoded", 7),
])
def test_field_numbers_match_caffe(message: str, field: str, num: int) -> None:
    assert number(getattr(caffe_pb2, message), field) == num


def test_defaults_and_enums_match_caffe() -> None:
    s = caffe_pb2.SolverParameter()
    assert (s.type, s.solver_mode, s.snapshot_format, s.random_seed) == \
        ("SGD", caffe_pb2.SolverParameter.GPU, caffe_pb2.SolverParameter.BINARYPROTO, -1)
    assert (s.delta, s.average_loss, s.clip_gradients, s.regularization_type) == \
        (pytest.approx(1e-8), 1, -1.0, "L2")
    assert caffe_pb2.NetState().phase == caffe_pb2.TEST
    assert caffe_pb2.ParamSpec().lr_mult == 1.0
    assert caffe_pb2.FillerParameter().type == "constant"
    assert caffe_pb2.FillerParameter().sparse == -1
    assert caffe_pb2.LossParameter().normalization == caffe_pb2.LossParameter.VALID
    assert caffe_pb2.LRNParameter().beta == pytest.approx(0.75)
    assert caffe_pb2.BatchNormParameter().moving_average_fraction == pytest.approx(0.999)
    assert caffe_pb2.ConvolutionParameter().bias_term is True
    assert caffe_pb2.V1LayerParameter.CONVOLUTION == 4
    assert caffe_pb2.V1LayerParameter.SOFTMAX_LOSS == 21
    assert caffe_pb2.V1LayerParameter.DECONVOLUTION == 39
    assert caffe_pb2.SolverParameter.ADAM == 5
    assert caffe_pb2.DataParameter.LMDB == 1
    assert caffe_pb2.EltwiseParameter.SUM == 1
    assert caffe_pb2.ReductionParameter.MEAN == 4
    assert caffe_pb2.HingeLossParameter.L2 == 2


def test_poseidon_extensions_use_numbers_caffe_never_uses() -> None:
    assert number(caffe_pb2.DataParameter, "shared_file_system") == 1001
    assert number(caffe_pb2.SolverState, "data_position") == 1001
    # A state with the extension still parses as plain Caffe would see it (unknown field).
    state = caffe_pb2.SolverState(iter=7, data_position=[640, 128])
    assert caffe_pb2.SolverState.FromString(state.SerializeToString()).data_position == [640, 128]


def test_wire_format_of_a_blob_is_caffes() -> None:
    # BlobShape{dim: [2, 3]} packed: field 7 (len 4) wrapping field 1 packed (len 2).
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend([2, 3])
    assert blob.SerializeToString() == bytes([0x3A, 0x04, 0x0A, 0x02, 0x02, 0x03])
