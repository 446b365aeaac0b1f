"""Caffe's file formats: prototxt nets and solvers, .caffemodel, .caffemodel.h5, .binaryproto,
.solverstate(.h5), and the V0/V1 -> current net upgrade Caffe applies when it reads a net.

Every reader turns a malformed or corrupt file into one `FormatError` line naming the file (and
line, column and field for text), never a protobuf or HDF5 traceback. Every writer is atomic: it
writes a temporary file beside the target and renames it into place, so a crash mid-write never
leaves a half-written model where a good one was.

Weights are exchanged as `LayerWeights` lists, ``[(layer_name, layer_type, [array, ...]), ...]``,
whatever the file format; `copy_weights_into` applies them to a Net by layer name as Caffe's
Net::CopyTrainedLayersFrom does.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import numpy as np
from google.protobuf import message as pb_message
from google.protobuf import text_format

from .pb import caffe_pb2

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
LayerWeights = list[tuple[str, str, list[np.ndarray]]]

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
ZIP_MAGIC = b"PK\x03\x04"


class FormatError(ValueError):
    """A file that is not what it claims to be; the message is one line naming file and place."""


# ---------------------------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------------------------

def _current_umask() -> int:
    # Read once at import: os.umask can only be read by setting it, which races with threads.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _current_umask()


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it vanishes."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp makes the file private; give it the mode an ordinary open() would.
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def _read_bytes(path: PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise FormatError(f"{path}: cannot read: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# Text format (prototxt)
# ---------------------------------------------------------------------------------------------

_LOCATION_PREFIX = re.compile(r"^\d+:\d+\s*:\s*")
_QUOTED_LINE_PREFIX = re.compile(r"^'.*?':\s*")
_FIELD_BEFORE_VALUE = re.compile(r"([A-Za-z_]\w*)\s*:?\s*$")
_STRUCTURAL = re.compile(r'^Expected "[{}:<>]"')


def _parse_error_message(err: text_format.ParseError, text: str, filename: str) -> str:
    line, col = err.GetLine(), err.GetColumn()
    msg = _QUOTED_LINE_PREFIX.sub("", _LOCATION_PREFIX.sub("", str(err)), count=1).strip()
    if line is None:
        return f"{filename}: {msg}"
    lines = text.splitlines()
    # Value errors point at the value; the identifier just before it is the offending field.
    if "field named" not in msg and not _STRUCTURAL.match(msg) and 0 < line <= len(lines):
        m = _FIELD_BEFORE_VALUE.search(lines[line - 1][: max(col - 1, 0)])
        if m:
            msg = f"field '{m.group(1)}': {msg}"
    return f"{filename}:{line}:{col}: {msg}"


def _parse_text(text: str, msg: pb_message.Message, filename: str) -> None:
    try:
        text_format.Parse(text, msg)
    except text_format.ParseError as e:
        raise FormatError(_parse_error_message(e, text, filename)) from None


def _read_text(path: PathLike) -> str:
    try:
        return _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{path}: not a text prototxt (byte {e.start} is not UTF-8)") from None


def parse_net_text(text: str, filename: str = "<string>", upgrade: bool = True
                   ) -> caffe_pb2.NetParameter:
    """A NetParameter from prototxt text, upgraded to the current dialect unless `upgrade=False`."""
    net = caffe_pb2.NetParameter()
    _parse_text(text, net, filename)
    if upgrade:
        upgrade_net(net, filename)
    return net


def read_net_prototxt(path: PathLike, upgrade: bool = True) -> caffe_pb2.NetParameter:
    return parse_net_text(_read_text(path), str(path), upgrade)


def parse_solver_text(text: str, filename: str = "<string>", upgrade: bool = True
                      ) -> caffe_pb2.SolverParameter:
    solver = caffe_pb2.SolverParameter()
    _parse_text(text, solver, filename)
    if upgrade:
        upgrade_solver(solver, filename)
    return solver


def read_solver_prototxt(path: PathLike, upgrade: bool = True) -> caffe_pb2.SolverParameter:
    return parse_solver_text(_read_text(path), str(path), upgrade)


def write_prototxt(path: PathLike, msg: pb_message.Message) -> None:
    atomic_write_bytes(path, text_format.MessageToString(msg).encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Net upgrade (Caffe's upgrade_proto.cpp)
# ---------------------------------------------------------------------------------------------

V1 = caffe_pb2.V1LayerParameter

#: V1 LayerType enum name -> current type string.
V1_TYPE_NAMES: dict[str, str] = {
    "NONE": "", "ABSVAL": "AbsVal", "ACCURACY": "Accuracy", "ARGMAX": "ArgMax", "BNLL": "BNLL",
    "CONCAT": "Concat", "CONTRASTIVE_LOSS": "ContrastiveLoss", "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution", "DATA": "Data", "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData", "EUCLIDEAN_LOSS": "EuclideanLoss", "ELTWISE": "Eltwise",
    "EXP": "Exp", "FLATTEN": "Flatten", "HDF5_DATA": "HDF5Data", "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss", "IM2COL": "Im2col", "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss", "INNER_PRODUCT": "InnerProduct", "LRN": "LRN",
    "MEMORY_DATA": "MemoryData", "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN", "POOLING": "Pooling", "POWER": "Power", "RELU": "ReLU", "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss", "SILENCE": "Silence",
    "SOFTMAX": "Softmax", "SOFTMAX_LOSS": "SoftmaxWithLoss", "SPLIT": "Split", "SLICE": "Slice",
    "TANH": "TanH", "WINDOW_DATA": "WindowData", "THRESHOLD": "Threshold",
}

#: V0 type string -> V1 LayerType enum name.
V0_TYPE_NAMES: dict[str, str] = {
    "accuracy": "ACCURACY", "bnll": "BNLL", "concat": "CONCAT", "conv": "CONVOLUTION",
    "data": "DATA", "dropout": "DROPOUT", "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN", "hdf5_data": "HDF5_DATA", "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL", "images": "IMAGE_DATA", "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT", "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS", "pool": "POOLING",
    "relu": "RELU", "sigmoid": "SIGMOID", "softmax": "SOFTMAX", "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT", "tanh": "TANH", "window_data": "WINDOW_DATA",
}

_ANY = "*"
#: V0 field -> {V0 type (or _ANY): "v1_sub_message.field"}; where a V0 field lands in V1.
_V0_FIELD_TARGETS: dict[str, dict[str, str]] = {
    "num_output": {"conv": "convolution_param.num_output",
                   "innerproduct": "inner_product_param.num_output"},
    "biasterm": {"conv": "convolution_param.bias_term",
                 "innerproduct": "inner_product_param.bias_term"},
    "weight_filler": {"conv": "convolution_param.weight_filler",
                      "innerproduct": "inner_product_param.weight_filler"},
    "bias_filler": {"conv": "convolution_param.bias_filler",
                    "innerproduct": "inner_product_param.bias_filler"},
    "pad": {"conv": "convolution_param.pad", "pool": "pooling_param.pad"},
    "kernelsize": {"conv": "convolution_param.kernel_size", "pool": "pooling_param.kernel_size"},
    "group": {"conv": "convolution_param.group"},
    "stride": {"conv": "convolution_param.stride", "pool": "pooling_param.stride"},
    "pool": {"pool": "pooling_param.pool"},
    "dropout_ratio": {"dropout": "dropout_param.dropout_ratio"},
    "local_size": {"lrn": "lrn_param.local_size"},
    "alpha": {"lrn": "lrn_param.alpha"},
    "beta": {"lrn": "lrn_param.beta"},
    "k": {"lrn": "lrn_param.k"},
    "source": {"data": "data_param.source", "hdf5_data": "hdf5_data_param.source",
               "images": "image_data_param.source", "window_data": "window_data_param.source",
               "infogain_loss": "infogain_loss_param.source"},
    "scale": {_ANY: "transform_param.scale"},
    "meanfile": {_ANY: "transform_param.mean_file"},
    "cropsize": {_ANY: "transform_param.crop_size"},
    "mirror": {_ANY: "transform_param.mirror"},
    "batchsize": {"data": "data_param.batch_size", "hdf5_data": "hdf5_data_param.batch_size",
                  "images": "image_data_param.batch_size",
                  "window_data": "window_data_param.batch_size"},
    "rand_skip": {"data": "data_param.rand_skip", "images": "image_data_param.rand_skip"},
    "shuffle_images": {"images": "image_data_param.shuffle"},
    "new_height": {"images": "image_data_param.new_height"},
    "new_width": {"images": "image_data_param.new_width"},
    "concat_dim": {"concat": "concat_param.concat_dim"},
    "det_fg_threshold": {"window_data": "window_data_param.fg_threshold"},
    "det_bg_threshold": {"window_data": "window_data_param.bg_threshold"},
    "det_fg_fraction": {"window_data": "window_data_param.fg_fraction"},
    "det_context_pad": {"window_data": "window_data_param.context_pad"},
    "det_crop_mode": {"window_data": "window_data_param.crop_mode"},
    "hdf5_output_param": {"hdf5_output": "hdf5_output_param"},
}

#: V1 data layer types whose own parameter message carried the transformation fields.
_V1_DATA_PARAMS = {"DATA": "data_param", "IMAGE_DATA": "image_data_param",
                   "WINDOW_DATA": "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

_SOLVER_TYPE_NAMES = {"SGD": "SGD", "NESTEROV": "Nesterov", "ADAGRAD": "AdaGrad",
                      "RMSPROP": "RMSProp", "ADADELTA": "AdaDelta", "ADAM": "Adam"}


def _assign(msg: pb_message.Message, field: str, value: Any) -> None:
    """Set a scalar, append to a repeated field, or copy a sub-message: whatever `field` is."""
    fd = msg.DESCRIPTOR.fields_by_name[field]
    if fd.is_repeated:
        getattr(msg, field).append(value)
    elif fd.message_type is not None:
        getattr(msg, field).CopyFrom(value)
    else:
        setattr(msg, field, value)


def _assign_path(msg: pb_message.Message, dotted: str, value: Any) -> None:
    *parents, field = dotted.split(".")
    for p in parents:
        msg = getattr(msg, p)
    _assign(msg, field, value)


def net_needs_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True when `upgrade_net` would change anything."""
    return (len(net.layers) > 0 or len(net.input) > 0 or _needs_batchnorm_upgrade(net))


def _needs_v0_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return any(l.HasField("layer") for l in net.layers)


def _needs_data_upgrade(net: caffe_pb2.NetParameter) -> bool:
    for layer in net.layers:
        field = _V1_DATA_PARAMS.get(V1.LayerType.Name(layer.type))
        if field and any(getattr(layer, field).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def _needs_batchnorm_upgrade(net: caffe_pb2.NetParameter) -> bool:
    return any(l.type == "BatchNorm" and len(l.param) == 3 for l in net.layer)


def _fold_v0_padding(net: caffe_pb2.NetParameter, where: str) -> list[caffe_pb2.V1LayerParameter]:
    """V0 nets had separate "padding" layers; fold each into the conv/pool layer it feeds."""
    last_top = {name: -1 for name in net.input}
    out: list[caffe_pb2.V1LayerParameter] = []
    for i, conn in enumerate(net.layers):
        v0 = conn.layer
        if v0.type != "padding":
            copy = V1()
            copy.CopyFrom(conn)
            out.append(copy)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise FormatError(f"{where}: layer '{v0.name}': unknown bottom blob '{blob}'")
            src_index = last_top[blob]
            if src_index < 0:
                continue
            src = net.layers[src_index]
            if src.layer.type != "padding":
                continue
            if v0.type not in ("conv", "pool") or len(conn.bottom) != 1 \
                    or len(src.bottom) != 1 or len(src.top) != 1:
                raise FormatError(f"{where}: V0 padding layer '{src.layer.name}' must feed a "
                                  f"single-input conv or pool layer, not '{v0.name}' ({v0.type})")
            out[-1].layer.pad = src.layer.pad
            out[-1].bottom[j] = src.bottom[0]
        for blob in conn.top:
            last_top[blob] = i
    return out


def _v0_layer_to_v1(conn: caffe_pb2.V1LayerParameter, where: str) -> tuple[V1, bool]:
    """One V0-wrapped layer as a V1 layer; the flag is False when some field had no V1 home."""
    v1 = V1()
    v1.bottom.extend(conn.bottom)
    v1.top.extend(conn.top)
    if not conn.HasField("layer"):
        return v1, True
    v0 = conn.layer
    ok = True
    if v0.HasField("name"):
        v1.name = v0.name
    if v0.HasField("type"):
        if v0.type not in V0_TYPE_NAMES:
            raise FormatError(f"{where}: layer '{v0.name}': unknown V0 layer type '{v0.type}'")
        v1.type = V1.LayerType.Value(V0_TYPE_NAMES[v0.type])
    v1.blobs.extend(v0.blobs)
    v1.blobs_lr.extend(v0.blobs_lr)
    v1.weight_decay.extend(v0.weight_decay)
    for fd, value in v0.ListFields():
        targets = _V0_FIELD_TARGETS.get(fd.name)
        if targets is None:
            continue  # name, type, blobs, blobs_lr, weight_decay: handled above
        target = targets.get(v0.type, targets.get(_ANY))
        if target is None:
            log.warning("%s: layer '%s': V0 field %s has no meaning for type %s; dropped",
                        where, v0.name, fd.name, v0.type)
            ok = False
            continue
        if fd.name == "pool":  # V0 and current PoolMethod enums share values
            value = caffe_pb2.PoolingParameter.PoolMethod.Value(
                caffe_pb2.V0LayerParameter.PoolMethod.Name(value))
        _assign_path(v1, target, value)
    return v1, ok


def _upgrade_v0(net: caffe_pb2.NetParameter, where: str) -> bool:
    layers = _fold_v0_padding(net, where)
    ok = True
    del net.layers[:]
    for conn in layers:
        v1, layer_ok = _v0_layer_to_v1(conn, where)
        ok &= layer_ok
        net.layers.add().CopyFrom(v1)
    return ok


def _upgrade_data_transform(net: caffe_pb2.NetParameter) -> None:
    for layer in net.layers:
        field = _V1_DATA_PARAMS.get(V1.LayerType.Name(layer.type))
        if not field:
            continue
        params = getattr(layer, field)
        for f in _TRANSFORM_FIELDS:
            if params.HasField(f):
                setattr(layer.transform_param, f, getattr(params, f))
                params.ClearField(f)


def _v1_layer_to_current(v1: V1, where: str) -> tuple[caffe_pb2.LayerParameter, bool]:
    layer = caffe_pb2.LayerParameter()
    ok = True
    layer.bottom.extend(v1.bottom)
    layer.top.extend(v1.top)
    if v1.HasField("name"):
        layer.name = v1.name
    layer.include.extend(v1.include)
    layer.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        layer.type = V1_TYPE_NAMES[V1.LayerType.Name(v1.type)]
    layer.blobs.extend(v1.blobs)

    def param(i: int) -> caffe_pb2.ParamSpec:
        while len(layer.param) <= i:
            layer.param.add()
        return layer.param[i]

    for i, name in enumerate(v1.param):
        param(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        param(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(
            V1.DimCheckMode.Name(mode))
    for i, lr in enumerate(v1.blobs_lr):
        param(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        param(i).decay_mult = decay
    layer.loss_weight.extend(v1.loss_weight)
    # Every *_param sub-message has the same name and type in V1 and in LayerParameter.
    for fd, value in v1.ListFields():
        if fd.name.endswith("_param"):
            getattr(layer, fd.name).CopyFrom(value)
    if v1.HasField("layer"):
        log.warning("%s: layer '%s' still holds a V0 layer; ignored", where, v1.name)
        ok = False
    return layer, ok


def _upgrade_v1(net: caffe_pb2.NetParameter, where: str) -> bool:
    ok = True
    if len(net.layer) > 0:
        log.warning("%s: net has both 'layer' and V1 'layers'; the 'layer' entries are dropped",
                    where)
        ok = False
    v1_layers = list(net.layers)
    del net.layer[:]
    for v1 in v1_layers:
        layer, layer_ok = _v1_layer_to_current(v1, where)
        ok &= layer_ok
        net.layer.add().CopyFrom(layer)
    del net.layers[:]
    return ok


def _upgrade_input(net: caffe_pb2.NetParameter, where: str) -> None:
    """Deprecated `input:` + `input_shape`/`input_dim` become a leading Input layer."""
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if has_shape or has_dim:
        if has_shape and len(net.input_shape) != len(net.input):
            raise FormatError(f"{where}: {len(net.input)} inputs but "
                              f"{len(net.input_shape)} input_shape entries")
        if not has_shape and len(net.input_dim) != 4 * len(net.input):
            raise FormatError(f"{where}: {len(net.input)} inputs need {4 * len(net.input)} "
                              f"input_dim values, found {len(net.input_dim)}")
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, name in enumerate(net.input):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i: 4 * i + 4])
        rest = list(net.layer)
        del net.layer[:]
        net.layer.add().CopyFrom(layer)
        net.layer.extend(rest)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


def _upgrade_batchnorm(net: caffe_pb2.NetParameter) -> None:
    """Old BatchNorm layers declared 3 learnable params; their statistics must not be learned."""
    for layer in net.layer:
        if layer.type == "BatchNorm" and len(layer.param) == 3:
            for p in layer.param:
                p.lr_mult = 0.0
                p.decay_mult = 0.0


def upgrade_net(net: caffe_pb2.NetParameter, where: str = "<net>") -> bool:
    """Upgrade `net` in place to the current dialect, in Caffe's order; True if it changed.

    V0 layers (padding layers folded in) -> V1; transformation fields of V1 data layers ->
    transform_param; V1 `layers` -> `layer` with type strings and ParamSpecs; `input` fields ->
    an Input layer; 3-param BatchNorm -> lr_mult/decay_mult 0. Fields with no equivalent are
    logged and dropped, as Caffe does.
    """
    changed = False
    ok = True
    if _needs_v0_upgrade(net):
        ok &= _upgrade_v0(net, where)
        changed = True
    if _needs_data_upgrade(net):
        _upgrade_data_transform(net)
        changed = True
    if len(net.layers) > 0:
        ok &= _upgrade_v1(net, where)
        changed = True
    if len(net.input) > 0:
        _upgrade_input(net, where)
        changed = True
    if _needs_batchnorm_upgrade(net):
        _upgrade_batchnorm(net)
        changed = True
    if not ok:
        log.warning("%s: upgraded with problems (see above)", where)
    return changed


def upgrade_solver(solver: caffe_pb2.SolverParameter, where: str = "<solver>") -> bool:
    """The deprecated `solver_type` enum becomes the `type` string; True if it changed."""
    if not solver.HasField("solver_type"):
        return False
    if solver.HasField("type"):
        raise FormatError(f"{where}: both 'solver_type' (deprecated) and 'type' are set; "
                          "keep only 'type'")
    name = caffe_pb2.SolverParameter.SolverType.Name(solver.solver_type)
    solver.type = _SOLVER_TYPE_NAMES[name]
    solver.ClearField("solver_type")
    return True


# ---------------------------------------------------------------------------------------------
# Blobs
# ---------------------------------------------------------------------------------------------

def _has_legacy_shape(blob: caffe_pb2.BlobProto) -> bool:
    return any(blob.HasField(f) for f in ("num", "channels", "height", "width"))


def blob_shape(blob: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """The blob's shape: `shape` if present, else the legacy (num, channels, height, width)."""
    if _has_legacy_shape(blob):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(int(d) for d in blob.shape.dim)


def blob_to_array(blob: caffe_pb2.BlobProto, diff: bool = False, where: str = "blob"
                  ) -> np.ndarray:
    """The blob's data (or diff) as an array of its shape: float32, or float64 for double_*."""
    shape = blob_shape(blob)
    doubles = blob.double_diff if diff else blob.double_data
    values = np.asarray(doubles, dtype=np.float64) if len(doubles) else \
        np.asarray(blob.diff if diff else blob.data, dtype=np.float32)
    count = int(np.prod(shape, dtype=np.int64))
    if values.size != count:
        raise FormatError(f"{where}: {values.size} values for shape {shape} ({count} expected)")
    return values.reshape(shape)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packed(field_number: int, values: np.ndarray, dtype: str) -> bytes:
    """The wire bytes of a packed repeated float/double field: far faster than extend()."""
    payload = np.ascontiguousarray(values, dtype=dtype).tobytes()
    return _varint((field_number << 3) | 2) + _varint(len(payload)) + payload


def array_to_blob(data: Any, diff: Any = None) -> caffe_pb2.BlobProto:
    """A BlobProto with `shape`; float64 arrays go to double_data/double_diff as Caffe's
    Blob<double> writes them, everything else to float data/diff."""
    from .backend import to_numpy

    data = to_numpy(data)
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(int(d) for d in data.shape)
    double = data.dtype == np.float64
    fields = _BLOB_FIELDS[double]
    wire = _packed(fields[0], data.ravel(), fields[2])
    if diff is not None:
        wire += _packed(fields[1], to_numpy(diff).ravel(), fields[2])
    blob.MergeFromString(wire)
    return blob


#: float64? -> (data field number, diff field number, little-endian dtype)
_BLOB_FIELDS = {
    False: (caffe_pb2.BlobProto.DATA_FIELD_NUMBER, caffe_pb2.BlobProto.DIFF_FIELD_NUMBER, "<f4"),
    True: (caffe_pb2.BlobProto.DOUBLE_DATA_FIELD_NUMBER,
           caffe_pb2.BlobProto.DOUBLE_DIFF_FIELD_NUMBER, "<f8"),
}


def shape_matches(target_shape: Sequence[int], blob: caffe_pb2.BlobProto) -> bool:
    """Caffe's Blob::ShapeEquals: a legacy 4-D blob matches a target of <= 4 axes whose shape,
    left-padded with 1s to 4 axes, equals (num, channels, height, width)."""
    target = tuple(int(d) for d in target_shape)
    if _has_legacy_shape(blob):
        return len(target) <= 4 and (1,) * (4 - len(target)) + target == blob_shape(blob)
    return target == blob_shape(blob)


def read_blobproto(path: PathLike) -> np.ndarray:
    """A .binaryproto file (e.g. a mean image) as an array of its stored shape."""
    blob = caffe_pb2.BlobProto()
    _parse_binary(_read_bytes(path), blob, path, "binaryproto")
    return blob_to_array(blob, where=str(path))


def write_blobproto(path: PathLike, array: Any) -> None:
    atomic_write_bytes(path, array_to_blob(array).SerializeToString())


# ---------------------------------------------------------------------------------------------
# Binary nets (.caffemodel)
# ---------------------------------------------------------------------------------------------

def _parse_binary(data: bytes, msg: pb_message.Message, path: PathLike, kind: str) -> None:
    if data.startswith(HDF5_MAGIC):
        raise FormatError(f"{path}: is an HDF5 file, not a binary {kind} (name it *.h5)")
    try:
        msg.ParseFromString(data)
    except (pb_message.DecodeError, RuntimeError, ValueError) as e:
        raise FormatError(f"{path}: not a valid {kind} (truncated or corrupt): {e}") from None


def read_net_binary(path: PathLike, upgrade: bool = True) -> caffe_pb2.NetParameter:
    """A binary NetParameter (.caffemodel), upgraded like a prototxt unless `upgrade=False`."""
    net = caffe_pb2.NetParameter()
    data = _read_bytes(path)
    _parse_binary(data, net, path, "caffemodel")
    if len(net.layer) == 0 and len(net.layers) == 0:
        raise FormatError(f"{path}: not a valid caffemodel (truncated or corrupt): "
                          f"no layers in {len(data)} bytes")
    net_to_weights(net, path)  # every blob's value count must match its shape
    if upgrade:
        upgrade_net(net, str(path))
    return net


def write_net_binary(path: PathLike, net: caffe_pb2.NetParameter) -> None:
    atomic_write_bytes(path, net.SerializeToString())


def _layer_type(layer: caffe_pb2.LayerParameter | caffe_pb2.V1LayerParameter) -> str:
    if isinstance(layer, caffe_pb2.V1LayerParameter):
        return V1_TYPE_NAMES[V1.LayerType.Name(layer.type)]
    return layer.type


def net_to_weights(net: caffe_pb2.NetParameter, path: PathLike = "<net>") -> LayerWeights:
    """The layers of a NetParameter as (name, type, [arrays]) (V1 `layers` included)."""
    return [(layer.name, _layer_type(layer),
             [blob_to_array(b, where=f"{path}: layer '{layer.name}' blob {j}")
              for j, b in enumerate(layer.blobs)])
            for layer in [*net.layer, *net.layers]]


def weights_to_net(weights: LayerWeights, name: str = "") -> caffe_pb2.NetParameter:
    net = caffe_pb2.NetParameter(name=name)
    for layer_name, layer_type, arrays in weights:
        layer = net.layer.add(name=layer_name, type=layer_type)
        for a in arrays:
            layer.blobs.add().CopyFrom(array_to_blob(a))
    return net


# ---------------------------------------------------------------------------------------------
# HDF5 (.caffemodel.h5, .solverstate.h5) in Caffe's layout
# ---------------------------------------------------------------------------------------------

def _h5py() -> Any:
    import h5py  # deferred: only HDF5 users pay for the import

    return h5py


@contextlib.contextmanager
def _open_h5(path: PathLike, kind: str) -> Iterator[Any]:
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise FormatError(f"{path}: cannot read: No such file or directory") from None
    except OSError as e:
        raise FormatError(f"{path}: not a valid {kind} (truncated or corrupt HDF5): "
                          f"{str(e).splitlines()[0]}") from None
    try:
        yield f
    except (KeyError, OSError, ValueError, TypeError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: not a valid {kind}: {str(e).splitlines()[0]}") from None
    finally:
        f.close()


def _h5_layer_arrays(group: Any, where: str) -> list[np.ndarray]:
    """Datasets "0", "1", ... of one layer group, in index order."""
    h5py = _h5py()
    names = [n for n, item in group.items() if isinstance(item, h5py.Dataset)]
    if sorted(names, key=lambda n: int(n) if n.isdigit() else -1) != \
            [str(i) for i in range(len(names))]:
        raise FormatError(f"{where}: expected datasets 0..{len(names) - 1}, found {names}")
    return [np.asarray(group[str(i)][()]) for i in range(len(names))]


def _h5_layers(group: Any, prefix: str, path: PathLike) -> LayerWeights:
    """Layer groups under `group`. A '/' in a layer name (GoogLeNet's "inception_3a/1x1") nests
    groups in HDF5, so a group holding only groups is a path step, not a layer."""
    h5py = _h5py()
    out: LayerWeights = []
    for name, item in group.items():
        if not isinstance(item, h5py.Group):
            continue
        full = f"{prefix}{name}"
        children = list(item.values())
        if any(isinstance(c, h5py.Dataset) for c in children) or not children:
            out.append((full, "", _h5_layer_arrays(item, f"{path}: layer '{full}'")))
        out.extend(_h5_layers(item, f"{full}/", path))
    return out


def read_net_hdf5(path: PathLike) -> LayerWeights:
    """Layers of a Caffe HDF5 snapshot (group data/<layer>/<i>); types are not stored: ""."""
    with _open_h5(path, "caffemodel.h5") as f:
        if "data" not in f:
            raise FormatError(f"{path}: not a Caffe HDF5 model (no 'data' group)")
        return _h5_layers(f["data"], "", path)


def write_net_hdf5(path: PathLike, weights: LayerWeights,
                   diffs: Sequence[Sequence[np.ndarray]] | None = None) -> None:
    """Caffe's HDF5 model layout: data/<layer>/<i> (and diff/<layer>/<i> when given).

    A layer name seen twice keeps its first arrays, as Caffe writes only owned parameters.
    """
    h5py = _h5py()
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        groups = [("data", [arrays for _, _, arrays in weights])]
        if diffs is not None:
            groups.append(("diff", list(diffs)))
        for group_name, per_layer in groups:
            top = f.create_group(group_name)
            for (layer_name, _, _), arrays in zip(weights, per_layer):
                if layer_name in top:
                    continue
                g = top.create_group(layer_name)
                for i, a in enumerate(arrays):
                    g.create_dataset(str(i), data=np.asarray(a))


# ---------------------------------------------------------------------------------------------
# NumPy archives (.npz, arrays named <layer>/<i>)
# ---------------------------------------------------------------------------------------------

def read_npz(path: PathLike) -> LayerWeights:
    """Layers of an .npz of arrays named `<layer>/<i>` (layer names may contain '/')."""
    layers: dict[str, dict[int, np.ndarray]] = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in z.files:
                name, _, index = key.rpartition("/")
                if not name or not index.isdigit():
                    raise FormatError(f"{path}: array '{key}' is not named <layer>/<index>")
                layers.setdefault(name, {})[int(index)] = z[key]
    except FileNotFoundError:
        raise FormatError(f"{path}: cannot read: No such file or directory") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"{path}: not a valid .npz (truncated or corrupt): {e}") from None
    out: LayerWeights = []
    for name, by_index in layers.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise FormatError(f"{path}: layer '{name}' has blobs {sorted(by_index)}, "
                              f"expected 0..{len(by_index) - 1}")
        out.append((name, "", [by_index[i] for i in range(len(by_index))]))
    return out


def write_npz(path: PathLike, weights: LayerWeights) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, _, blobs in weights:
        for i, a in enumerate(blobs):
            arrays.setdefault(f"{name}/{i}", np.asarray(a))
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.savez(fh, **arrays)


# ---------------------------------------------------------------------------------------------
# Any weights file
# ---------------------------------------------------------------------------------------------

def format_by_name(path: PathLike) -> str:
    """"hdf5", "npz" or "binary" from the file name alone (what writers go by)."""
    name = str(path).lower()
    if name.endswith((".h5", ".hdf5")):
        return "hdf5"
    if name.endswith(".npz"):
        return "npz"
    return "binary"


def weights_format(path: PathLike) -> str:
    """The format of a file to read: by name, else by the magic bytes of an existing file."""
    fmt = format_by_name(path)
    if fmt != "binary":
        return fmt
    with contextlib.suppress(OSError):
        with open(path, "rb") as fh:
            head = fh.read(8)
        if head.startswith(HDF5_MAGIC):
            return "hdf5"
        if head.startswith(ZIP_MAGIC):
            return "npz"
    return "binary"


def read_weights(path: PathLike) -> LayerWeights:
    """[(layer_name, layer_type, [arrays])] from a .caffemodel, .caffemodel.h5 or .npz."""
    fmt = weights_format(path)
    if fmt == "hdf5":
        return read_net_hdf5(path)
    if fmt == "npz":
        return read_npz(path)
    return net_to_weights(read_net_binary(path), path)


def write_weights(path: PathLike, weights: LayerWeights, name: str = "") -> None:
    """Write weights in the format the suffix names (.h5 / .npz / anything else: binary)."""
    fmt = format_by_name(path)
    if fmt == "hdf5":
        write_net_hdf5(path, weights)
    elif fmt == "npz":
        write_npz(path, weights)
    else:
        write_net_binary(path, weights_to_net(weights, name))


# ---------------------------------------------------------------------------------------------
# Nets <-> weights
# ---------------------------------------------------------------------------------------------

def _fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def copy_weights_into(net: Any, source: PathLike | LayerWeights | caffe_pb2.NetParameter
                      ) -> list[str]:
    """Copy parameters into `net` by layer name (Caffe's CopyTrainedLayersFrom).

    `source` is a weights file, a NetParameter, or a LayerWeights list. Source layers the net
    lacks are ignored (logged); for the others the blob count and every shape must match,
    except that a legacy 4-D blob matches any shape Caffe's ShapeEquals accepts. Returns the
    names of the layers copied.
    """
    from .backend import get_array_module

    where = str(source) if isinstance(source, (str, os.PathLike)) else "weights"
    if isinstance(source, (str, os.PathLike)):
        if weights_format(source) == "binary":
            source = read_net_binary(source)
        else:
            source = read_weights(source)
    if isinstance(source, caffe_pb2.NetParameter):
        if len(source.layers):
            source = caffe_pb2.NetParameter.FromString(source.SerializeToString())
            upgrade_net(source, where)
        items = [(l.name, list(l.blobs)) for l in source.layer]
    else:
        items = [(name, list(arrays)) for name, _, arrays in source]

    # The first layer of a name wins, as in Caffe's lookup.
    targets: dict[str, Any] = {}
    for layer_name, layer in zip(net.layer_names, net.layers):
        targets.setdefault(layer_name, layer)

    copied = []
    for name, blobs in items:
        layer = targets.get(name)
        if layer is None:
            log.info("Ignoring source layer %s", name)
            continue
        target_blobs = layer.blobs
        if len(target_blobs) != len(blobs):
            raise FormatError(f"{where}: layer '{name}': {len(blobs)} parameter blobs in the "
                              f"file, the net's layer has {len(target_blobs)}")
        for j, (target, src) in enumerate(zip(target_blobs, blobs)):
            if isinstance(src, caffe_pb2.BlobProto):
                ok = shape_matches(target.shape, src)
                src_shape = blob_shape(src)
                array = blob_to_array(src, where=f"{where}: layer '{name}' blob {j}")
            else:
                array = np.asarray(src)
                src_shape = array.shape
                ok = tuple(src_shape) == tuple(target.shape)
            if not ok:
                raise FormatError(
                    f"{where}: layer '{name}' blob {j}: shape mismatch: file has "
                    f"{_fmt_shape(src_shape)}, the net expects {_fmt_shape(target.shape)} "
                    "(rename the layer to learn it from scratch)")
            xp = get_array_module(target.data)
            target.data[...] = xp.asarray(array.reshape(target.shape), dtype=target.data.dtype)
        copied.append(name)
    return copied


def net_to_proto(net: Any, write_diff: bool = False) -> caffe_pb2.NetParameter:
    """A NetParameter of the net's layers (their parameters as built) with their blobs, as
    Caffe's Net::ToProto writes a .caffemodel."""
    out = caffe_pb2.NetParameter(name=net.name or "")
    for layer in net.layers:
        lp = out.layer.add()
        lp.CopyFrom(layer.param)
        lp.ClearField("blobs")
        if not lp.HasField("phase"):
            lp.phase = caffe_pb2.Phase.Value(str(layer.phase))
        for blob in layer.blobs:
            lp.blobs.add().CopyFrom(array_to_blob(blob.data, blob.diff if write_diff else None))
    return out


def save_net(net: Any, path: PathLike, write_diff: bool = False) -> None:
    """Snapshot a Net's weights: Caffe's HDF5 layout for *.h5, else a binary .caffemodel."""
    if format_by_name(path) == "hdf5":
        from .backend import to_numpy

        written: set[str] = set()
        weights: LayerWeights = []
        diffs: list[list[np.ndarray]] = []
        for layer in net.layers:
            if layer.name in written:
                continue
            written.add(layer.name)
            weights.append((layer.name, layer.param.type, [to_numpy(b.data) for b in layer.blobs]))
            diffs.append([to_numpy(b.diff) for b in layer.blobs])
        write_net_hdf5(path, weights, diffs if write_diff else None)
    else:
        write_net_binary(path, net_to_proto(net, write_diff))


#: The name Net.save uses.
save_weights = save_net


# ---------------------------------------------------------------------------------------------
# Solver state
# ---------------------------------------------------------------------------------------------

def read_solverstate(path: PathLike) -> caffe_pb2.SolverState:
    """A .solverstate (binary) or .solverstate.h5 (Caffe's HDF5 keys) as a SolverState."""
    if weights_format(path) == "hdf5":
        state = caffe_pb2.SolverState()
        with _open_h5(path, "solverstate.h5") as f:
            state.iter = int(np.asarray(f["iter"][()]).ravel()[0])
            state.current_step = int(np.asarray(f["current_step"][()]).ravel()[0])
            if "learned_net" in f:
                raw = f["learned_net"][()]
                state.learned_net = raw.decode() if isinstance(raw, bytes) else str(raw)
            history = f["history"] if "history" in f else {}
            for i in range(len(history)):
                state.history.add().CopyFrom(array_to_blob(np.asarray(history[str(i)][()])))
            if "data_position" in f:
                state.data_position.extend(int(v) for v in np.asarray(f["data_position"][()]))
        return state
    state = caffe_pb2.SolverState()
    _parse_binary(_read_bytes(path), state, path, "solverstate")
    for j, blob in enumerate(state.history):
        blob_to_array(blob, where=f"{path}: history blob {j}")  # validates counts
    return state


def solverstate_history(state: caffe_pb2.SolverState) -> list[np.ndarray]:
    return [blob_to_array(b, where=f"history blob {j}") for j, b in enumerate(state.history)]


def write_solverstate(path: PathLike, state: caffe_pb2.SolverState) -> None:
    """Binary, or Caffe's HDF5 keys (iter, learned_net, current_step, history/<i>) for *.h5."""
    if format_by_name(path) != "hdf5":
        atomic_write_bytes(path, state.SerializeToString())
        return
    h5py = _h5py()
    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.create_dataset("iter", data=np.array([state.iter], dtype=np.int32))
        f.create_dataset("learned_net", data=np.bytes_(state.learned_net.encode()))
        f.create_dataset("current_step", data=np.array([state.current_step], dtype=np.int32))
        g = f.create_group("history")
        for i, arr in enumerate(solverstate_history(state)):
            g.create_dataset(str(i), data=arr)
        if len(state.data_position):
            f.create_dataset("data_position", data=np.array(state.data_position, dtype=np.int64))


def resolve_learned_net(state_path: PathLike, state: caffe_pb2.SolverState) -> Path:
    """The weights file a solverstate names: as given if it exists, else beside the state file
    (Caffe writes a bare file name relative to its working directory)."""
    named = Path(state.learned_net)
    if named.exists():
        return named
    beside = Path(state_path).parent / named.name
    if beside.exists():
        return beside
    raise FormatError(f"{state_path}: learned_net '{state.learned_net}' not found (looked at "
                      f"{named} and {beside})")
