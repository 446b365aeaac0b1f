"""Writes the zoo's ImageNet-size nets: AlexNet, CaffeNet, GoogLeNet, VGG-16, VGG-19,
VGG-19-22K and ResNet-50.

These nets are long and regular (VGG repeats one conv, GoogLeNet nine inception modules,
ResNet-50 sixteen bottlenecks), so they are described here as short Python functions and
one builder turns each description into prototxt. The written files are committed: users
never need to run this script. For every model it writes

    <model>/train_val.prototxt   LMDB Data layers (TRAIN and TEST), the net, losses, accuracies
    <model>/deploy.prototxt      an Input blob, the same net, Softmax "prob"
    <model>/solver.prototxt

Usage, from the repository root:

    python models/generate.py           # (re)write the files
    python models/generate.py --check   # exit 1 and name the stale files, writing nothing

Layer names follow the published Caffe releases of each model, so their .caffemodel
weights load by name (VGG-19-22K names its classifier fc8_22k, so VGG-19 weights
initialise everything else).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
if str(MODELS_DIR.parent) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(MODELS_DIR.parent))

from google.protobuf import text_format

from engine.pb import caffe_pb2

P = caffe_pb2.PoolingParameter
IMAGENET_MEAN_BGR = (104, 117, 123)
IMAGENET_TRAIN = "../data/imagenet/ilsvrc12_train_lmdb"
IMAGENET_VAL = "../data/imagenet/ilsvrc12_val_lmdb"


def gaussian(std: float) -> caffe_pb2.FillerParameter:
    return caffe_pb2.FillerParameter(type="gaussian", std=std)


def xavier() -> caffe_pb2.FillerParameter:
    return caffe_pb2.FillerParameter(type="xavier")


def msra() -> caffe_pb2.FillerParameter:
    return caffe_pb2.FillerParameter(type="msra")


@dataclass
class Head:
    """A classifier output: SoftmaxWithLoss in training, Accuracy top-1/top-5 in TEST."""

    logits: str
    loss: str = "loss"
    top1: str = "accuracy"
    top5: str = "accuracy_top5"
    weight: float = 1.0


class NetBuilder:
    """Appends layers to a NetParameter; each method returns the name of its top blob.

    With ``deploy=True`` the learning-only details (param multipliers, fillers) are left
    out: a deploy net gets its weights from a .caffemodel.
    """

    def __init__(self, name: str, deploy: bool):
        self.net = caffe_pb2.NetParameter(name=name)
        self.deploy = deploy

    def layer(self, name: str, type_: str, bottoms: list[str], top: str | None = None
              ) -> caffe_pb2.LayerParameter:
        lp = self.net.layer.add(name=name, type=type_)
        lp.bottom.extend(bottoms)
        lp.top.append(top if top is not None else name)
        return lp

    def _learnable(self, lp: caffe_pb2.LayerParameter, msg, filler, bias: float | None) -> None:
        """Weights at the base rate with weight decay; biases at twice the rate without."""
        if self.deploy:
            return
        lp.param.add(lr_mult=1, decay_mult=1)
        msg.weight_filler.CopyFrom(filler)
        if bias is not None:
            lp.param.add(lr_mult=2, decay_mult=0)
            msg.bias_filler.CopyFrom(caffe_pb2.FillerParameter(type="constant", value=bias))

    def conv(self, name: str, bottom: str, num_output: int, kernel: int, *, stride: int = 1,
             pad: int = 0, group: int = 1, filler: caffe_pb2.FillerParameter,
             bias: float | None = 0.0) -> str:
        """Convolution; ``bias=None`` leaves the bias out (a BatchNorm follows)."""
        lp = self.layer(name, "Convolution", [bottom])
        cp = lp.convolution_param
        cp.num_output = num_output
        cp.kernel_size.append(kernel)
        if stride != 1:
            cp.stride.append(stride)
        if pad:
            cp.pad.append(pad)
        if group != 1:
            cp.group = group
        if bias is None:
            cp.bias_term = False
        self._learnable(lp, cp, filler, bias)
        return name

    def fc(self, name: str, bottom: str, num_output: int, *,
           filler: caffe_pb2.FillerParameter, bias: float = 0.0) -> str:
        lp = self.layer(name, "InnerProduct", [bottom])
        lp.inner_product_param.num_output = num_output
        self._learnable(lp, lp.inner_product_param, filler, bias)
        return name

    def relu(self, name: str, blob: str) -> str:
        self.layer(name, "ReLU", [blob], blob)  # in place: saves one activation's memory
        return blob

    def dropout(self, name: str, blob: str, ratio: float) -> str:
        self.layer(name, "Dropout", [blob], blob).dropout_param.dropout_ratio = ratio
        return blob

    def pool(self, name: str, bottom: str, method: int, kernel: int = 0, stride: int = 1,
             pad: int = 0, global_pooling: bool = False) -> str:
        pp = self.layer(name, "Pooling", [bottom]).pooling_param
        pp.pool = method
        if global_pooling:
            pp.global_pooling = True
        else:
            pp.kernel_size, pp.stride = kernel, stride
        if pad:
            pp.pad = pad
        return name

    def lrn(self, name: str, bottom: str) -> str:
        """Across-channel LRN with AlexNet's constants (n=5, alpha=1e-4, beta=0.75)."""
        rp = self.layer(name, "LRN", [bottom]).lrn_param
        rp.local_size, rp.alpha, rp.beta = 5, 1e-4, 0.75
        return name

    def concat(self, name: str, bottoms: list[str]) -> str:
        self.layer(name, "Concat", bottoms)
        return name

    def eltwise_sum(self, name: str, bottoms: list[str]) -> str:
        self.layer(name, "Eltwise", bottoms).eltwise_param.operation = \
            caffe_pb2.EltwiseParameter.SUM
        return name

    def batch_norm(self, bn_name: str, scale_name: str, blob: str) -> str:
        """BatchNorm (normalise) + Scale (learned gamma, beta), both in place, as Caffe splits it.

        BatchNorm's three blobs are running statistics, not learned: lr_mult 0 keeps any
        solver from touching them. It uses batch statistics in TRAIN and the running ones
        in TEST (use_global_stats left unset). Gamma and beta get no weight decay.
        """
        bn = self.layer(bn_name, "BatchNorm", [blob], blob)
        sc = self.layer(scale_name, "Scale", [blob], blob)
        sc.scale_param.bias_term = True
        if not self.deploy:
            for _ in range(3):
                bn.param.add(lr_mult=0, decay_mult=0)
            for _ in range(2):
                sc.param.add(lr_mult=1, decay_mult=0)
        return blob

    def input(self, shape: tuple[int, ...]) -> None:
        self.layer("data", "Input", []).input_param.shape.add().dim.extend(shape)

    def imagenet_data(self, crop: int, train_batch: int, test_batch: int) -> None:
        """Two LMDB Data layers: random crops and mirrors to train, centre crops to test."""
        for phase, source, batch in ((caffe_pb2.TRAIN, IMAGENET_TRAIN, train_batch),
                                     (caffe_pb2.TEST, IMAGENET_VAL, test_batch)):
            lp = self.layer("data", "Data", [], "data")
            lp.top.append("label")
            lp.include.add(phase=phase)
            tp = lp.transform_param
            tp.mirror = phase == caffe_pb2.TRAIN
            tp.crop_size = crop
            tp.mean_value.extend(IMAGENET_MEAN_BGR)
            dp = lp.data_param
            dp.source, dp.batch_size, dp.backend = source, batch, caffe_pb2.DataParameter.LMDB

    def outputs(self, heads: list[Head]) -> None:
        """Losses and TEST-phase accuracies, or Softmax "prob" on the main head in deploy."""
        if self.deploy:
            self.layer("prob", "Softmax", [heads[-1].logits])
            return
        for h in heads:
            for name, k in ((h.top1, 1), (h.top5, 5)):
                acc = self.layer(name, "Accuracy", [h.logits, "label"])
                acc.include.add(phase=caffe_pb2.TEST)
                if k != 1:
                    acc.accuracy_param.top_k = k
            loss = self.layer(h.loss, "SoftmaxWithLoss", [h.logits, "label"])
            if h.weight != 1.0:
                loss.loss_weight.append(h.weight)


# ---------------------------------------------------------------------------------------
# The nets. Each function appends the layers after "data" and returns the classifier heads
# (the main head last).
# ---------------------------------------------------------------------------------------
def alexnet_body(b: NetBuilder, caffenet: bool) -> list[Head]:
    """AlexNet (one-tower form, groups standing in for the two GPUs); CaffeNet pools before
    normalising instead of after."""
    def normalise_and_pool(i: int, x: str) -> str:
        if caffenet:
            return b.lrn(f"norm{i}", b.pool(f"pool{i}", x, P.MAX, 3, 2))
        return b.pool(f"pool{i}", b.lrn(f"norm{i}", x), P.MAX, 3, 2)

    x = b.relu("relu1", b.conv("conv1", "data", 96, 11, stride=4, filler=gaussian(0.01)))
    x = normalise_and_pool(1, x)
    x = b.relu("relu2", b.conv("conv2", x, 256, 5, pad=2, group=2, filler=gaussian(0.01),
                               bias=0.1))
    x = normalise_and_pool(2, x)
    x = b.relu("relu3", b.conv("conv3", x, 384, 3, pad=1, filler=gaussian(0.01)))
    x = b.relu("relu4", b.conv("conv4", x, 384, 3, pad=1, group=2, filler=gaussian(0.01),
                               bias=0.1))
    x = b.relu("relu5", b.conv("conv5", x, 256, 3, pad=1, group=2, filler=gaussian(0.01),
                               bias=0.1))
    x = b.pool("pool5", x, P.MAX, 3, 2)
    return [Head(classifier_mlp(b, x, 1000, "fc8", gaussian(0.005), gaussian(0.01), 0.1))]


def classifier_mlp(b: NetBuilder, x: str, classes: int, last: str,
                   hidden_filler: caffe_pb2.FillerParameter,
                   last_filler: caffe_pb2.FillerParameter, hidden_bias: float,
                   hidden: int = 4096) -> str:
    """AlexNet's and VGG's fc6/fc7 (4096, ReLU, dropout 0.5) and the class layer."""
    for i in (6, 7):
        x = b.fc(f"fc{i}", x, hidden, filler=hidden_filler, bias=hidden_bias)
        b.dropout(f"drop{i}", b.relu(f"relu{i}", x), 0.5)
    return b.fc(last, x, classes, filler=last_filler)


def vgg_body(b: NetBuilder, convs_per_block: tuple[int, ...], classes: int = 1000,
             last: str = "fc8", narrow: int = 1) -> list[Head]:
    """VGG: five blocks of 3x3 convs (64, 128, 256, 512, 512 channels), each ending in a
    2x2 max pool, then the fc6/fc7/classifier MLP. MSRA init trains it from scratch
    without the paper's shallower-net warm start (He et al. 2015). ``narrow`` divides every
    width (channels, hidden units; the caller divides the classes)."""
    x = "data"
    widths = [w // narrow for w in (64, 128, 256, 512, 512)]
    for i, (reps, width) in enumerate(zip(convs_per_block, widths), 1):
        for j in range(1, reps + 1):
            x = b.relu(f"relu{i}_{j}", b.conv(f"conv{i}_{j}", x, width, 3, pad=1,
                                               filler=msra()))
        x = b.pool(f"pool{i}", x, P.MAX, 2, 2)
    return [Head(classifier_mlp(b, x, classes, last, gaussian(0.005), gaussian(0.01), 0.1,
                                hidden=4096 // narrow))]


# (#1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool projection) per module, Szegedy et al. Table 1
INCEPTION = {
    "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128), "5b": (384, 192, 384, 48, 128, 128),
}


def googlenet_body(b: NetBuilder) -> list[Head]:
    """GoogLeNet (Inception v1): stem, nine inception modules, and in training two auxiliary
    classifiers on 4a and 4d whose losses count 0.3 each."""
    def conv_relu(name: str, x: str, n: int, k: int, stride: int = 1, pad: int = 0) -> str:
        # "inception_3a/3x3" is rectified by "inception_3a/relu_3x3"
        head, _, tail = name.rpartition("/")
        return b.relu(f"{head}/relu_{tail}",
                      b.conv(name, x, n, k, stride=stride, pad=pad, filler=xavier(), bias=0.2))

    def inception(tag: str, x: str) -> str:
        n1, r3, n3, r5, n5, pp = INCEPTION[tag]
        p = f"inception_{tag}/"
        branches = [
            conv_relu(p + "1x1", x, n1, 1),
            conv_relu(p + "3x3", conv_relu(p + "3x3_reduce", x, r3, 1), n3, 3, pad=1),
            conv_relu(p + "5x5", conv_relu(p + "5x5_reduce", x, r5, 1), n5, 5, pad=2),
            conv_relu(p + "pool_proj", b.pool(p + "pool", x, P.MAX, 3, 1, pad=1), pp, 1),
        ]
        return b.concat(p + "output", branches)

    def auxiliary(n: int, x: str) -> Head:
        p = f"loss{n}/"
        y = b.pool(p + "ave_pool", x, P.AVE, 5, 3)
        y = b.relu(p + "relu_conv", b.conv(p + "conv", y, 128, 1, filler=xavier(), bias=0.2))
        y = b.relu(p + "relu_fc", b.fc(p + "fc", y, 1024, filler=xavier(), bias=0.2))
        b.dropout(p + "drop_fc", y, 0.7)
        return Head(b.fc(p + "classifier", y, 1000, filler=xavier()),
                    p + "loss", p + "top-1", p + "top-5", 0.3)

    x = conv_relu("conv1/7x7_s2", "data", 64, 7, stride=2, pad=3)
    x = b.lrn("pool1/norm1", b.pool("pool1/3x3_s2", x, P.MAX, 3, 2))
    x = conv_relu("conv2/3x3_reduce", x, 64, 1)
    x = b.lrn("conv2/norm2", conv_relu("conv2/3x3", x, 192, 3, pad=1))
    x = b.pool("pool2/3x3_s2", x, P.MAX, 3, 2)
    heads = []
    for tag in INCEPTION:
        x = inception(tag, x)
        if tag in ("3b", "4e"):
            x = b.pool(f"pool{tag[0]}/3x3_s2", x, P.MAX, 3, 2)
        if tag in ("4a", "4d") and not b.deploy:
            heads.append(auxiliary(len(heads) + 1, x))
    x = b.pool("pool5/7x7_s1", x, P.AVE, 7, 1)
    b.dropout("pool5/drop_7x7_s1", x, 0.4)
    heads.append(Head(b.fc("loss3/classifier", x, 1000, filler=xavier()),
                      "loss3/loss3", "loss3/top-1", "loss3/top-5"))
    return heads


# (bottleneck blocks, bottleneck width, output width, first block's stride) for res2..res5
RESNET50_STAGES = ((3, 64, 256, 1), (4, 128, 512, 2), (6, 256, 1024, 2), (3, 512, 2048, 2))


def resnet50_body(b: NetBuilder) -> list[Head]:
    """ResNet-50 (He et al. 2016) as MSRA released it for Caffe: convs without bias, each
    followed by BatchNorm + Scale; stride on the first 1x1 of a stage; projection (1x1
    conv) shortcuts where the shape changes. The final average pool is global, so the net
    also runs on inputs other than 224x224."""
    def conv_bn(name: str, x: str, n: int, k: int, stride: int = 1, relu: bool = True) -> str:
        # MSRA's names: res2a_branch2a -> bn2a_branch2a, scale2a_branch2a; conv1 -> bn_conv1
        suffix = name[3:] if name.startswith("res") else "_" + name
        y = b.batch_norm("bn" + suffix, "scale" + suffix,
                         b.conv(name, x, n, k, stride=stride, pad=k // 2, filler=msra(),
                                bias=None))
        return b.relu(name + "_relu", y) if relu else y

    x = conv_bn("conv1", "data", 64, 7, stride=2)
    x = b.pool("pool1", x, P.MAX, 3, 2)
    for stage, (blocks, width, out, stride) in enumerate(RESNET50_STAGES, 2):
        for k in range(blocks):
            tag = f"res{stage}{'abcdef'[k]}"
            s = stride if k == 0 else 1
            shortcut = conv_bn(tag + "_branch1", x, out, 1, s, relu=False) if k == 0 else x
            y = conv_bn(tag + "_branch2a", x, width, 1, s)
            y = conv_bn(tag + "_branch2b", y, width, 3)
            y = conv_bn(tag + "_branch2c", y, out, 1, relu=False)
            x = b.relu(tag + "_relu", b.eltwise_sum(tag, [shortcut, y]))
    x = b.pool("pool5", x, P.AVE, global_pooling=True)
    return [Head(b.fc("fc1000", x, 1000, filler=msra()))]


# ---------------------------------------------------------------------------------------
# The zoo: one entry per model folder
# ---------------------------------------------------------------------------------------
@dataclass
class Model:
    folder: str
    net_name: str
    about: str  # header comment of the net files
    body: Callable[[NetBuilder], list[Head]]
    crop: int
    train_batch: int
    solver: dict  # SolverParameter fields besides net, test_iter, snapshot_prefix
    solver_about: str
    test_batch: int = 50


VGG_SOLVER = {"type": "SGD", "base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0005,
              "lr_policy": "multistep", "gamma": 0.1, "stepvalue": [100000, 200000, 300000],
              "max_iter": 370000, "iter_size": 8, "test_interval": 5000, "display": 20,
              "average_loss": 20, "snapshot": 10000}
VGG_SOLVER_ABOUT = ("32 images x iter_size 8 = 256 per iteration, as in the paper; on N "
                    "workers divide iter_size by N. lr 0.01, /10 at 100k, 200k, 300k; "
                    "370k iterations = 74 epochs of ILSVRC-2012.")
ALEXNET_SOLVER = {"type": "SGD", "base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0005,
                  "lr_policy": "step", "gamma": 0.1, "stepsize": 100000, "max_iter": 450000,
                  "test_interval": 1000, "display": 20, "snapshot": 10000}
ALEXNET_SOLVER_ABOUT = ("256 images per iteration; lr 0.01, /10 every 100k iterations; "
                        "450k iterations = 90 epochs of ILSVRC-2012.")

MODELS = [
    Model("alexnet", "AlexNet",
          "AlexNet (Krizhevsky, Sutskever & Hinton, NIPS 2012): five convs (conv2, conv4, "
          "conv5 in two groups), LRN, max pooling, two 4096-wide fc layers with dropout. "
          "60,965,224 learnable parameters.",
          lambda b: alexnet_body(b, caffenet=False), 227, 256,
          ALEXNET_SOLVER, ALEXNET_SOLVER_ABOUT),
    Model("caffenet", "CaffeNet",
          "CaffeNet (BVLC's reference variant of AlexNet): pooling before normalisation. "
          "60,965,224 learnable parameters.",
          lambda b: alexnet_body(b, caffenet=True), 227, 256,
          ALEXNET_SOLVER, ALEXNET_SOLVER_ABOUT),
    Model("googlenet", "GoogLeNet",
          "GoogLeNet / Inception v1 (Szegedy et al., CVPR 2015). 6,998,552 learnable "
          "parameters in the deploy net; the two auxiliary heads used in training add "
          "6,379,728.",
          googlenet_body, 224, 32,
          {"type": "SGD", "base_lr": 0.01, "momentum": 0.9, "weight_decay": 0.0002,
           "lr_policy": "poly", "power": 0.5, "max_iter": 2400000, "test_interval": 4000,
           "test_initialization": False, "display": 40, "average_loss": 40, "snapshot": 40000},
          "32 images per iteration; lr 0.01 decaying polynomially (power 0.5) to 0 at 2.4M "
          "iterations (60 epochs); skip the initial test, it is long and says nothing."),
    Model("vgg16", "VGG_ILSVRC_16_layers",
          "VGG-16, configuration D (Simonyan & Zisserman, ICLR 2015): 13 3x3 convs in five "
          "blocks, three fc layers. 138,357,544 learnable parameters.",
          lambda b: vgg_body(b, (2, 2, 3, 3, 3)), 224, 32, VGG_SOLVER, VGG_SOLVER_ABOUT),
    Model("vgg19", "VGG_ILSVRC_19_layers",
          "VGG-19, configuration E (Simonyan & Zisserman, ICLR 2015): 16 3x3 convs in five "
          "blocks, three fc layers. 143,667,240 learnable parameters.",
          lambda b: vgg_body(b, (2, 2, 4, 4, 4)), 224, 32, VGG_SOLVER, VGG_SOLVER_ABOUT),
    Model("vgg19_22k", "VGG19_22K",
          "Poseidon's benchmark net (Zhang et al. 2017): VGG-19 with a 21,841-way classifier "
          "for the full ImageNet-22K. 229,052,817 learnable parameters, 89.5M of them in "
          "fc8_22k: the layer that makes synchronisation the bottleneck. Reads the ILSVRC-12 "
          "LMDBs (labels below 21,841 are valid) unless you point it at ImageNet-22K ones.",
          lambda b: vgg_body(b, (2, 2, 4, 4, 4), classes=21841, last="fc8_22k"), 224, 32,
          VGG_SOLVER, VGG_SOLVER_ABOUT),
    Model("vgg19_22k_s4", "VGG19_22K_S4",
          "VGG-19-22K narrowed 4x for the emulated cluster (poseidon bench cluster): every "
          "width / 4 (convs 16..128 channels, fc6/fc7 1024, 5,460 classes), so parameters and "
          "FLOPs are both ~1/16 of VGG-19-22K's and its ratios stay: fc layers hold 91% of the "
          "parameters (10.4x the convs), and compute per byte of gradient is the same. "
          "iter_size 1, so the hybrid planner may use SFB.",
          lambda b: vgg_body(b, (2, 2, 4, 4, 4), classes=21841 // 4, last="fc8_22k", narrow=4),
          224, 32, {**VGG_SOLVER, "iter_size": 1},
          "32 images per iteration per worker, no accumulation (SFB needs iter_size 1); "
          "otherwise VGG's schedule."),
    Model("resnet50", "ResNet-50",
          "ResNet-50 (He, Zhang, Ren & Sun, CVPR 2016): bottleneck residual blocks "
          "(3, 4, 6, 3) with BatchNorm + Scale after every conv and projection shortcuts. "
          "25,557,032 learnable parameters (plus BatchNorm's running statistics).",
          resnet50_body, 224, 32,
          {"type": "SGD", "base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001,
           "lr_policy": "multistep", "gamma": 0.1, "stepvalue": [150000, 300000, 450000],
           "max_iter": 500000, "iter_size": 8, "test_interval": 5000, "display": 20,
           "average_loss": 20, "snapshot": 10000},
          "32 images x iter_size 8 = 256 per iteration; on N workers divide iter_size by N. "
          "lr 0.1, /10 at epochs 30, 60, 90 (5,005 iterations each); 100 epochs."),
]

GENERATED = "# Generated by models/generate.py: edit the generator, not this file.\n"
VAL_IMAGES = 50000  # ILSVRC-2012 validation set


def comment(text: str, width: int = 88) -> str:
    """``text`` as '# ' lines wrapped at ``width``."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width - 2:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    return "".join(f"# {ln}\n" for ln in lines)


def build_net(model: Model, deploy: bool) -> caffe_pb2.NetParameter:
    b = NetBuilder(model.net_name, deploy)
    if deploy:
        b.input((10, 3, model.crop, model.crop))  # 10: Caffe's oversampled crops of one image
    else:
        b.imagenet_data(model.crop, model.train_batch, model.test_batch)
    b.outputs(model.body(b))
    return b.net


def build_solver(model: Model) -> caffe_pb2.SolverParameter:
    s = caffe_pb2.SolverParameter(net="train_val.prototxt",
                                  snapshot_prefix=f"../data/{model.folder}")
    s.test_iter.append(VAL_IMAGES // model.test_batch)
    for key, value in model.solver.items():
        if isinstance(value, list):
            getattr(s, key).extend(value)
        else:
            setattr(s, key, value)
    return s


def render_all() -> dict[str, str]:
    """Every generated file: path relative to models/ -> text."""
    paths_note = comment("Make the LMDBs with Caffe's convert_imageset into models/data/"
                         "imagenet/. Relative paths resolve against this file's folder "
                         "first, then the working directory.")
    out = {}
    for m in MODELS:
        about = comment(m.about)
        out[f"{m.folder}/train_val.prototxt"] = (
            GENERATED + about + paths_note + text_format.MessageToString(build_net(m, False)))
        out[f"{m.folder}/deploy.prototxt"] = (
            GENERATED + about + comment("Deploy form: BGR images minus the mean "
                                        f"{IMAGENET_MEAN_BGR}, {m.crop}x{m.crop}, in; class "
                                        "probabilities \"prob\" out.")
            + text_format.MessageToString(build_net(m, True)))
        out[f"{m.folder}/solver.prototxt"] = (
            GENERATED + comment(f"{m.net_name}: {m.solver_about} Testing: "
                                f"{VAL_IMAGES // m.test_batch} batches of {m.test_batch} = "
                                "the 50,000 validation images.")
            + text_format.MessageToString(build_solver(m)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="report files that differ from the generator; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for rel, text in render_all().items():
        path = MODELS_DIR / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(rel)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale (run python models/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print(f"wrote {len(stale)} file(s) under {MODELS_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
