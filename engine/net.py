"""Net: the layer graph built from a NetParameter, with Caffe's forward and backward.

Building follows Caffe's Net::Init: filter layers by NetState rules, insert Split layers
where a blob feeds several consumers, wire bottoms and tops (in-place when a top names
its own bottom), share parameters by name, and decide which layers need backward.
``backward`` calls ``on_layer_done(layer_index)`` right after each layer's backward, which
is how the communicator sends a layer's gradients while the layers below still compute.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np

from . import backend
from .blob import Blob, BlobTooLarge, building_shapes_only, check_fits
from .context import RunContext
from .layer_types import Layer, LayerError, create_layer
from .net_param import NetError, UnknownLayerType, check_layer_types, filter_net, insert_splits
from . import timeline
from .pb import caffe_pb2

PHASES = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST}


# ---------------------------------------------------------------------------------------
class Net:
    """A Caffe net, pycaffe-style: ``blobs``, ``params``, ``forward``, ``backward``."""

    def __init__(self, source: str | Path | Any, phase: str = "TRAIN", weights: str | None = None,
                 level: int = 0, stages: Iterable[str] = (), dtype: Any = np.float32,
                 context: RunContext | None = None, origin: str | None = None):
        """``source``: a net prototxt or a NetParameter; ``origin``: the file a NetParameter
        was read from (a solver's net), for errors to name."""
        if phase not in PHASES:
            raise NetError(f"phase must be TRAIN or TEST, not {phase!r}")
        self.phase = phase
        self.dtype = np.dtype(dtype)
        self.context = context or RunContext()
        if isinstance(source, (str, Path)):
            from .caffe_io import read_net_prototxt
            self.source = str(source)
            param = read_net_prototxt(source)
            here = Path(source).resolve().parent
            if here not in self.context.base_dirs:
                self.context = RunContext(self.context.rank, self.context.world_size,
                                          [here, *self.context.base_dirs, Path.cwd()])
        else:
            self.source = origin or (f"net '{source.name}'" if source.name else "<NetParameter>")
            param = source
        state = caffe_pb2.NetState()
        state.CopyFrom(param.state)
        state.phase = PHASES[phase]
        state.level = level
        del state.stage[:]
        state.stage.extend(list(param.state.stage) + list(stages))
        try:
            filtered = filter_net(param, state)
            check_layer_types(filtered, self.source)
            self.param = insert_splits(filtered)
            self.name: str = self.param.name
            self._build()
        except UnknownLayerType:
            raise
        except (NetError, LayerError) as e:
            raise NetError(f"{self.source}: {e}") from None
        if weights:
            self.copy_from(weights)

    # -- construction ------------------------------------------------------------------
    def _build(self) -> None:
        xp = backend.xp_default()
        self.layers: list[Layer] = []
        self.layer_names: list[str] = []
        self.bottom_vecs: list[list[Blob]] = []
        self.top_vecs: list[list[Blob]] = []
        self.bottom_need_backward: list[list[bool]] = []
        self.blobs: "OrderedDict[str, Blob]" = OrderedDict()
        self.params: "OrderedDict[str, list[Blob]]" = OrderedDict()
        self.input_blob_names: list[str] = []
        self.learnable_params: list[Blob] = []
        self.params_lr: list[float] = []
        self.params_weight_decay: list[float] = []
        self.param_names: list[str] = []
        self.param_layer_index: list[int] = []
        #: (layer index, top index, loss weight) of every top that adds to the loss
        self.loss_tops: list[tuple[int, int, float]] = []
        blob_need_backward: dict[str, bool] = {}
        available: list[str] = []
        owners: dict[str, tuple[Blob, int]] = {}  # shared param name -> (blob, learnable idx)
        layer_need_backward: list[bool] = []
        counted: set[int] = set()  # addresses of the arrays whose bytes are in ``allocated``
        allocated = 0

        for li, lp in enumerate(self.param.layer):
            if len(lp.propagate_down) and len(lp.propagate_down) != len(lp.bottom):
                raise NetError(f"layer '{lp.name}': propagate_down has {len(lp.propagate_down)} "
                               f"entries for {len(lp.bottom)} bottoms")
            layer = create_layer(lp, self.phase)
            layer.context = self.context
            bottoms, need_bw = [], []
            for j, name in enumerate(lp.bottom):
                if name not in self.blobs or name not in available:
                    raise NetError(f"layer '{lp.name}': unknown bottom blob '{name}' "
                                   f"(bottom index {j})")
                bottoms.append(self.blobs[name])
                nb = blob_need_backward[name]
                if len(lp.propagate_down):
                    nb = bool(lp.propagate_down[j])
                need_bw.append(nb)
                available.remove(name)
            tops = []
            for j, name in enumerate(lp.top):
                if j < len(lp.bottom) and lp.bottom[j] == name:
                    tops.append(self.blobs[name])  # in place
                elif name in self.blobs:
                    raise NetError(f"layer '{lp.name}': top blob '{name}' produced by "
                                   "multiple sources")
                else:
                    blob = Blob((), self.dtype, xp, name)
                    self.blobs[name] = blob
                    tops.append(blob)
                    if lp.type == "Input":
                        self.input_blob_names.append(name)
                available.append(name)
            if layer.is_loss:
                # Caffe's AutoTopBlobs: a loss layer written without a top still gets one,
                # anonymous, so its loss counts; no other layer can read it.
                needed = max(layer.min_tops or 0, layer.exact_num_tops or 0)
                tops += [Blob((), self.dtype, xp, f"({lp.name} loss)")
                         for _ in range(needed - len(tops))]

            layer.check_blob_counts(bottoms, tops)
            try:
                layer.setup(bottoms, tops)
                layer.reshape(bottoms, tops)
            except BlobTooLarge as e:
                raise NetError(f"layer '{lp.name}' ({lp.type}): {e}") from None
            if xp is np and not building_shapes_only():  # the net so far must fit too
                for b in [*tops, *layer.blobs]:
                    for a in (b.data, b.diff):
                        if a.ctypes.data not in counted:  # views (in place, reshaped) once
                            counted.add(a.ctypes.data)
                            allocated += a.nbytes
                try:
                    check_fits(f"the net up to layer '{lp.name}' (its blobs and parameters)",
                               allocated)
                except BlobTooLarge as e:
                    raise NetError(str(e)) from None
            if not layer.param_propagate_down or len(layer.param_propagate_down) != len(layer.blobs):
                layer.param_propagate_down = [True] * len(layer.blobs)

            weights = list(lp.loss_weight)
            if not weights and layer.is_loss:
                weights = [1.0]
            if weights and len(weights) != len(tops):
                if not (layer.is_loss and not lp.loss_weight):
                    raise NetError(f"layer '{lp.name}': loss_weight must be given for every "
                                   f"top ({len(weights)} weights, {len(tops)} tops)")
            for j, w in enumerate(weights[:len(tops)]):
                if w:
                    self.loss_tops.append((li, j, float(w)))

            need_backward = any(need_bw)
            for pj, blob in enumerate(layer.blobs):
                spec = lp.param[pj] if pj < len(lp.param) else caffe_pb2.ParamSpec()
                lr = spec.lr_mult
                layer.param_propagate_down[pj] = lr != 0
                need_backward |= lr != 0
                self._append_param(li, lp, pj, blob, spec, owners, layer)

            self.layers.append(layer)
            self.layer_names.append(lp.name)
            self.bottom_vecs.append(bottoms)
            self.top_vecs.append(tops)
            self.bottom_need_backward.append(need_bw)
            if layer.blobs and lp.name not in self.params:
                # pycaffe's net.params: only layers that have parameters. Caffe allows two
                # layers of one name (MNIST autoencoder's two "loss" layers); by name, the
                # first one with parameters is the one found, as in Caffe.
                self.params[lp.name] = layer.blobs
            layer_need_backward.append(need_backward)
            for name in lp.top:
                blob_need_backward[name] = blob_need_backward.get(name, False) or need_backward

        self._prune_backward(layer_need_backward)
        if self.param.force_backward:
            for li, layer in enumerate(self.layers):
                layer_need_backward[li] = True
                nb = self.bottom_need_backward[li]
                for j in range(len(nb)):
                    nb[j] = nb[j] or layer.allow_force_backward(j)
                layer.param_propagate_down = [True] * len(layer.blobs)
        self.layer_need_backward = layer_need_backward
        self.output_blob_names = sorted(available)  # Caffe keeps them in a std::set
        self.layer_by_name = {}
        for name, layer in zip(self.layer_names, self.layers):
            self.layer_by_name.setdefault(name, layer)
        self.data_layers = [l for l in self.layers if hasattr(l, "seek")]

    def _append_param(self, li: int, lp: Any, pj: int, blob: Blob, spec: Any,
                      owners: dict[str, tuple[Blob, int]], layer: Layer) -> None:
        name = spec.name
        if not name or name not in owners:
            idx = len(self.learnable_params)
            self.learnable_params.append(blob)
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            self.param_names.append(f"{lp.name}/{pj}")
            self.param_layer_index.append(li)
            if name:
                owners[name] = (blob, idx)
            return
        owner, idx = owners[name]
        strict = spec.share_mode != caffe_pb2.ParamSpec.PERMISSIVE
        if (strict and owner.shape != blob.shape) or owner.count != blob.count:
            raise NetError(f"layer '{lp.name}': shared parameter '{name}' has shape "
                           f"{blob.shape}, its owner has {owner.shape}")
        if spec.HasField("lr_mult"):
            self.params_lr[idx] = spec.lr_mult
        if spec.HasField("decay_mult"):
            self.params_weight_decay[idx] = spec.decay_mult
        if owner.shape != blob.shape:  # PERMISSIVE: same memory, this layer's shape
            view = Blob((), self.dtype, name=blob.name)
            view.data = owner.data.reshape(blob.shape)
            view.diff = owner.diff.reshape(blob.shape)
            layer.blobs[pj] = view
        else:
            layer.blobs[pj] = owner

    def _prune_backward(self, layer_need_backward: list[bool]) -> None:
        """Caffe's pass from the top: a layer that contributes to no loss needs no backward."""
        under_loss: set[str] = set()
        skip: set[str] = set()
        loss_tops = {(li, j) for li, j, _ in self.loss_tops}
        for li in range(len(self.layers) - 1, -1, -1):
            lp = self.param.layer[li]
            contributes, skip_down = False, True
            for j, name in enumerate(lp.top):
                if (li, j) in loss_tops or name in under_loss:
                    contributes = True
                if name not in skip:
                    skip_down = False
                if contributes and not skip_down:
                    break
            nb = self.bottom_need_backward[li]
            if layer_need_backward[li] and skip_down:
                layer_need_backward[li] = False
                nb[:] = [False] * len(nb)
            if not contributes:
                layer_need_backward[li] = False
            for j, name in enumerate(lp.bottom):
                if contributes:
                    under_loss.add(name)
                else:
                    nb[j] = False
                if not nb[j]:
                    skip.add(name)

    # -- running ----------------------------------------------------------------------------
    def reshape(self) -> None:
        for layer, b, t in zip(self.layers, self.bottom_vecs, self.top_vecs):
            layer.reshape(b, t)

    def forward_prefilled(self, start: int = 0, end: int | None = None,
                          before_layer: Callable[[int], None] | None = None) -> float:
        """Run layers [start, end]; returns the weighted loss. ``before_layer(i)`` runs first
        for each layer (the communicator's per-layer wait)."""
        end = len(self.layers) - 1 if end is None else end
        for i in range(start, end + 1):
            if before_layer is not None:
                before_layer(i)
            self.forward_layer(i)
        return self.loss()

    def forward_layer(self, i: int) -> None:
        """Reshape then forward layer ``i`` (Caffe's Layer::Forward reshapes every time)."""
        layer, b, t = self.layers[i], self.bottom_vecs[i], self.top_vecs[i]
        tl = timeline.current
        start = tl.now()
        layer.reshape(b, t)
        layer.forward(b, t)
        if tl.active:
            tl.complete(self.layer_names[i], "forward", start)

    def backward_layer(self, i: int) -> None:
        if self.layer_need_backward[i]:
            tl = timeline.current
            start = tl.now()
            self.layers[i].backward(self.top_vecs[i], self.bottom_need_backward[i],
                                    self.bottom_vecs[i])
            if tl.active:
                tl.complete(self.layer_names[i], "backward", start)

    def seed_loss_diffs(self, skip: Collection[int] = ()) -> None:
        """Write each loss top's weight into its diff (backward starts from there), except
        the blobs whose id is in ``skip`` (diffs the caller gave)."""
        for li, j, w in self.loss_tops:
            if id(self.top_vecs[li][j]) not in skip:
                self.top_vecs[li][j].diff[...] = w

    def loss(self) -> float:
        return float(sum(w * float(self.top_vecs[li][j].data.sum())
                         for li, j, w in self.loss_tops))

    def forward(self, blobs: Sequence[str] | None = None, start: str | None = None,
                end: str | None = None, **inputs: Any) -> dict[str, Any]:
        """pycaffe's forward: copy keyword inputs into blobs (reshaping the blob when the
        array's shape differs), run layers ``start``..``end`` (names, inclusive), return the
        output blobs' data (``end``'s tops when given) and those named in ``blobs``."""
        for name, value in inputs.items():
            if name not in self.blobs:
                raise NetError(f"{self.source}: no blob named '{name}' to feed")
            blob = self.blobs[name]
            xp = backend.get_array_module(blob.data)
            arr = xp.asarray(value, dtype=blob.dtype)
            if arr.shape != blob.shape:
                blob.reshape(arr.shape)
            blob.data[...] = arr
        first = self.layer_index(start) if start is not None else 0
        last = self.layer_index(end) if end is not None else len(self.layers) - 1
        self.forward_prefilled(first, last)
        names = list(self.param.layer[last].top) if end is not None else list(self.output_blob_names)
        return {n: self.blobs[n].data for n in [*names, *(blobs or ())]}

    def backward(self, diffs: Sequence[str] | None = None, start: str | None = None,
                 end: str | None = None, on_layer_done: Callable[[int], None] | None = None,
                 **top_diffs: Any) -> dict[str, Any]:
        """pycaffe's backward: copy keyword diffs into the output blobs' diffs, run layers
        ``start`` down to ``end`` (names, inclusive), return the input blobs' diffs (``end``'s
        bottoms when given) and those named in ``diffs``. Loss outputs not given start from
        their loss weight. ``on_layer_done(i)`` runs after each layer, in reverse order."""
        for name, value in top_diffs.items():
            if name not in self.blobs:
                raise NetError(f"{self.source}: no blob named '{name}' to set a diff of")
            blob = self.blobs[name]
            blob.diff[...] = backend.get_array_module(blob.diff).asarray(value, dtype=blob.dtype)
        self.seed_loss_diffs(skip={id(self.blobs[n]) for n in top_diffs})
        first = self.layer_index(start) if start is not None else len(self.layers) - 1
        last = self.layer_index(end) if end is not None else 0
        for i in range(first, last - 1, -1):
            self.backward_layer(i)
            if on_layer_done is not None:
                on_layer_done(i)
        names = list(self.param.layer[last].bottom) if end is not None else list(self.input_blob_names)
        return {n: self.blobs[n].diff for n in [*names, *(diffs or ())]}

    def layer_index(self, name: str) -> int:
        """The index of the first layer called ``name``."""
        try:
            return self.layer_names.index(name)
        except ValueError:
            raise NetError(f"{self.source}: no layer named '{name}'") from None

    def forward_backward(self) -> float:
        loss = self.forward_prefilled()
        self.backward()
        return loss

    def clear_param_diffs(self) -> None:
        for p in self.learnable_params:
            p.diff[...] = 0

    # -- weights --------------------------------------------------------------------------------
    def copy_from(self, path: str | Path) -> None:
        """Copy weights by layer name from a .caffemodel or .caffemodel.h5 (Caffe's CopyTrainedLayersFrom)."""
        from .caffe_io import copy_weights_into
        copy_weights_into(self, path)

    def to_proto(self, write_diff: bool = False) -> Any:
        from .caffe_io import net_to_proto
        return net_to_proto(self, write_diff)

    def save(self, path: str | Path) -> None:
        """Write the weights as .caffemodel (or .caffemodel.h5 by suffix), atomically."""
        from .caffe_io import save_weights
        save_weights(self, path)

    def share_weights_from(self, other: "Net") -> None:
        """Use ``other``'s parameter blobs for layers of the same name (Caffe's
        ShareTrainedLayersWith): a test net sees the train net's weights without copies."""
        for name, blobs in other.params.items():
            mine = self.layer_by_name.get(name)
            if mine is None or not blobs:
                continue
            if len(mine.blobs) != len(blobs):
                raise NetError(f"layer '{name}': {len(mine.blobs)} parameter blobs here, "
                               f"{len(blobs)} in the net to share from")
            for j, src in enumerate(blobs):
                if mine.blobs[j].shape != src.shape:
                    raise NetError(f"layer '{name}': parameter {j} has shape "
                                   f"{mine.blobs[j].shape}, the shared one {src.shape}")
                mine.blobs[j] = src
            self.params[name] = mine.blobs

    def __repr__(self) -> str:
        return f"<Net '{self.name}' {self.phase}: {len(self.layers)} layers>"
