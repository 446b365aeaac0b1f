"""Caffe's upgrade of old nets and solvers to the current dialect (upgrade_proto.cpp).

Nets: V0 layers (with their padding layers folded in) -> V1, transformation fields of V1 data
layers -> transform_param, V1 `layers` -> `layer`, `input` fields -> an Input layer, and
3-param BatchNorm -> statistics not learned. Solvers: the `solver_type` enum -> the `type`
string.
"""
from __future__ import annotations

import logging
from typing import Any

from google.protobuf import message as pb_message

from ..pb import caffe_pb2
from .files import FormatError

log = logging.getLogger(__name__)


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
