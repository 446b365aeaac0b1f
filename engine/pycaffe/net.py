"""``caffe.Net``: the engine's Net under pycaffe's constructor and attribute names.

pycaffe reaches a net through ``blobs``, ``params``, ``layers``, ``forward``/``backward`` (the
engine's own) and through names that index Caffe's internal vectors: ``_layer_names``,
``_blob_names``, ``inputs``/``outputs``, ``top_names``/``bottom_names``, ``layer_dict``.
This subclass adds those, the batched helpers (``forward_all``, ``forward_backward_all``),
HDF5 weights, ``share_with`` and the per-layer callbacks, so that scripts written against
BVLC's pycaffe run unchanged; every computation stays the engine's.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import zip_longest
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from engine.blob import Blob
from engine.layers.python_layer import TEST, TRAIN
from engine.net import Net as EngineNet

_PHASE_NAMES = {TRAIN: "TRAIN", TEST: "TEST"}


def phase_name(phase: Any) -> str:
    """caffe.TRAIN / caffe.TEST (0 / 1) -> the engine's "TRAIN" / "TEST"."""
    if isinstance(phase, bool) or phase not in _PHASE_NAMES:
        raise ValueError(f"phase must be caffe.TRAIN or caffe.TEST, got {phase!r}")
    return _PHASE_NAMES[phase]


class Net(EngineNet):
    """pycaffe's Net: ``Net(file, phase, level=0, stages=None, weights=None)`` or the older
    ``Net(file, weights, phase)``."""

    def __init__(self, network_file: str | Path | Any, *args: Any, phase: int | None = None,
                 weights: str | Path | None = None, level: int = 0,
                 stages: Sequence[str] | None = None, **engine_kwargs: Any):
        if len(args) == 2:
            weights, phase = args
        elif len(args) == 1:
            phase = args[0]
        elif args:
            raise TypeError("Net(network_file, [weights,] phase, level=0, stages=None, "
                            "weights=None)")
        # By keyword the engine's "TRAIN"/"TEST" pass too: the engine's Solver builds these nets
        engine_kwargs["phase"] = phase if not args and phase in ("TRAIN", "TEST") \
            else phase_name(phase)
        self._callbacks: dict[str, list[Callable[[int], None]]] = {
            k: [] for k in ("before_forward", "after_forward", "before_backward", "after_backward")}
        super().__init__(network_file if not isinstance(network_file, Path) else str(network_file),
                         weights=str(weights) if weights is not None else None, level=level,
                         stages=list(stages or ()), **engine_kwargs)

    # -- Caffe's vectors, by the names pycaffe gives them -----------------------------------
    @property
    def _layer_names(self) -> list[str]:
        return self.layer_names

    @property
    def _blob_names(self) -> list[str]:
        return list(self.blobs)

    @property
    def _blobs(self) -> list[Blob]:
        return list(self.blobs.values())

    def _blob_index(self) -> dict[int, int]:
        return {id(b): i for i, b in enumerate(self.blobs.values())}

    def _top_ids(self, i: int) -> list[int]:
        index = self._blob_index()
        return [index[id(b)] for b in self.top_vecs[i] if id(b) in index]

    def _bottom_ids(self, i: int) -> list[int]:
        index = self._blob_index()
        return [index[id(b)] for b in self.bottom_vecs[i]]

    @property
    def _inputs(self) -> list[int]:
        names = self._blob_names
        return [names.index(n) for n in self.input_blob_names]

    @property
    def _outputs(self) -> list[int]:
        names = self._blob_names
        return [names.index(n) for n in self.output_blob_names]

    @property
    def _blob_loss_weights(self) -> list[float]:
        weights = {id(self.top_vecs[li][j]): w for li, j, w in self.loss_tops}
        return [weights.get(id(b), 0.0) for b in self.blobs.values()]

    @property
    def blob_loss_weights(self) -> "OrderedDict[str, float]":
        return OrderedDict(zip(self.blobs, self._blob_loss_weights))

    @property
    def layer_dict(self) -> "OrderedDict[str, Any]":
        return OrderedDict(zip(self.layer_names, self.layers))

    @property
    def inputs(self) -> list[str]:
        return list(self.input_blob_names)

    @property
    def outputs(self) -> list[str]:
        return list(self.output_blob_names)

    @property
    def top_names(self) -> "OrderedDict[str, list[str]]":
        return self._names_by_layer(self.param.layer, "top")

    @property
    def bottom_names(self) -> "OrderedDict[str, list[str]]":
        return self._names_by_layer(self.param.layer, "bottom")

    def _names_by_layer(self, layers: Any, field: str) -> "OrderedDict[str, list[str]]":
        return OrderedDict((lp.name, list(getattr(lp, field))) for lp in layers)

    # -- callbacks (pycaffe's before_forward ... after_backward) ---------------------------
    def before_forward(self, run: Callable[[int], None]) -> None:
        self._callbacks["before_forward"].append(run)

    def after_forward(self, run: Callable[[int], None]) -> None:
        self._callbacks["after_forward"].append(run)

    def before_backward(self, run: Callable[[int], None]) -> None:
        self._callbacks["before_backward"].append(run)

    def after_backward(self, run: Callable[[int], None]) -> None:
        self._callbacks["after_backward"].append(run)

    def _run_callbacks(self, event: str, i: int) -> None:
        for run in self._callbacks[event]:
            run(i)

    def forward_layer(self, i: int) -> None:
        self._run_callbacks("before_forward", i)
        super().forward_layer(i)
        self._run_callbacks("after_forward", i)

    def backward_layer(self, i: int) -> None:
        self._run_callbacks("before_backward", i)
        super().backward_layer(i)
        self._run_callbacks("after_backward", i)

    # -- weights -------------------------------------------------------------------------
    def save_hdf5(self, filename: str | Path) -> None:
        """The weights as Caffe's HDF5 (data/<layer>/<i>), whatever the file's suffix."""
        from engine.caffe_io import save_weights
        save_weights(self, filename, fmt="hdf5")

    def load_hdf5(self, filename: str | Path) -> None:
        """Copy weights from Caffe's HDF5 layout (the file's magic bytes say so, whatever its
        name)."""
        self.copy_from(filename)

    def share_with(self, other: EngineNet) -> None:
        """Caffe's ShareTrainedLayersWith: use ``other``'s parameter blobs by layer name."""
        self.share_weights_from(other)

    # -- batched helpers -----------------------------------------------------------------
    def _batch(self, arrays: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """Cut equal-length arrays into batches of the net's batch size; the last one padded
        with zeros."""
        if not arrays:
            return
        num = len(next(iter(arrays.values())))
        batch = next(iter(self.blobs.values())).shape[0]
        for i in range(0, num - num % batch, batch):
            yield {name: a[i:i + batch] for name, a in arrays.items()}
        rest = num % batch
        if rest:
            yield {name: np.concatenate([a[-rest:], np.zeros((batch - rest, *a.shape[1:]),
                                                             dtype=np.asarray(a).dtype)])
                   for name, a in arrays.items()}

    def forward_all(self, blobs: Sequence[str] | None = None, **inputs: Any) -> dict[str, Any]:
        """forward over arrays of any length, batch by batch; outputs concatenated, padding cut."""
        outs, _ = self._run_batches(blobs, None, inputs, backward=False)
        return outs

    def forward_backward_all(self, blobs: Sequence[str] | None = None,
                             diffs: Sequence[str] | None = None,
                             **arrays: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """forward then backward over arrays of any length: inputs feed forward, output diffs
        feed backward; returns (all blobs, all diffs), padding cut."""
        return self._run_batches(blobs, diffs, arrays, backward=True)

    def _run_batches(self, blobs: Sequence[str] | None, diffs: Sequence[str] | None,
                     arrays: Mapping[str, Any], backward: bool
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        all_outs: dict[str, list[Any]] = {n: [] for n in {*self.outputs, *(blobs or ())}}
        all_diffs: dict[str, list[Any]] = {n: [] for n in {*self.inputs, *(diffs or ())}} \
            if backward else {}
        fwd = self._batch({n: a for n, a in arrays.items() if n not in self.outputs})
        bwd = self._batch({n: a for n, a in arrays.items() if n in self.outputs}) \
            if backward else iter(())
        for fb, bb in zip_longest(fwd, bwd, fillvalue={}):
            for name, data in self.forward(blobs=blobs, **fb).items():
                all_outs[name].extend(np.array(data, copy=True))
            if backward:
                for name, diff in self.backward(diffs=diffs, **bb).items():
                    all_diffs[name].extend(np.array(diff, copy=True))
        n = len(next(iter(arrays.values()))) if arrays else None
        return ({k: np.asarray(v)[:n] for k, v in all_outs.items()},
                {k: np.asarray(v)[:n] for k, v in all_diffs.items()})

    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Hand arrays to the net's first layer, a MemoryData layer (pycaffe's contract:
        float32, C-contiguous, N x C x H x W data, N labels)."""
        layer = self.layers[0] if self.layers else None
        if layer is None or layer.type != "MemoryData":
            raise RuntimeError("set_input_arrays may only be called if the first layer is a "
                               "MemoryDataLayer")
        if labels.ndim == 1:
            labels = labels[:, None, None, None]
        for name, arr in (("data array", data), ("labels array", labels)):
            if not arr.flags.c_contiguous:
                raise RuntimeError(f"{name} must be C contiguous")
            if arr.ndim != 4:
                raise RuntimeError(f"{name} must be 4-d")
            if arr.dtype != np.float32:
                raise RuntimeError(f"{name} must be float32")
        if len(data) != len(labels):
            raise RuntimeError("data and labels must have the same first dimension")
        layer.reset(data, labels.reshape(len(labels)))
