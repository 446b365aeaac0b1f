"""`poseidon bench data`: the data path alone, against the real Caffe on the same data-only net.

The timed net is one Data layer and a Silence layer, TRAIN phase, so ``caffe time`` and
Poseidon's ``time`` (engine.perf.timing, the same loop) measure reading, decoding and transforming
a batch and nothing else. The Data layer's batch size and transform_param come from
``--net`` (its first TRAIN Data layer) or default to an ImageNet net's: batch 128, crop 227,
mirror, three mean values. Without ``--db``, two LMDBs of the same 512 pictures are made
(256x256 crops of scikit-learn's two sample photographs, natural images whose JPEGs decode
at a typical speed): one of raw Datum records, one of JPEG (quality 90) records.

Every run is a fresh process with one BLAS thread; the peers and decoder counts alternate
within each repetition, so all see the same machine load; medians are reported, with
Poseidon's time against Caffe's and each decoder count's images/s against one decoder's,
and where a Poseidon batch's time went (record reading, decoding, transforming: summed over
the decoders; the net's wait for the prefetch queue). A Caffe built without OpenCV cannot
decode encoded records: that peer is then reported as failed on that database, with the
line Caffe said.
"""
from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from google.protobuf import text_format

from engine.pb import caffe_pb2

from .time import ROOT, caffe_time

#: records of the databases made when none is given
SAMPLE_RECORDS = 512
SAMPLE_SIZE = 256

#: The child is a `poseidon` process as training runs one: the allocator tuned first
#: (engine/allocator.py). It times the steady state: each batch array of the prefetch queue is
#: new memory on its first turn, whose pages the kernel zeroes as the decoders first write them
#: (79 MB a batch at ImageNet's size), a cost a training run pays once. More decoders keep more
#: batches in flight, so a short run that counted the first turn penalised them (2 decoders,
#: 20 batches: 1.44-1.52x one; 80 batches: 1.61-1.76x).
_CHILD = r"""
import json, sys
from engine.allocator import tune_allocator
tune_allocator()
from engine.data.decoders import DecodeStats
from engine.net import Net
from engine.perf.timing import time_net
net = Net(sys.argv[1], phase="TRAIN")
layer = net.data_layers[0]
for _ in range(layer.param.data_param.prefetch + 2):
    net.forward_prefilled()
layer.stats = DecodeStats()
report = time_net(net, int(sys.argv[2]))
stats = layer.stats.as_dict()
layer.close()
print(json.dumps({"ms": report.total_ms, "stats": stats}))
"""


@dataclass(frozen=True)
class DataNet:
    """The Data layer that is timed: its batch and transform_param."""

    batch: int = 128
    transform: str = "crop_size: 227 mirror: true mean_value: 104 mean_value: 117 mean_value: 123"

    @classmethod
    def from_net(cls, path: Path) -> "DataNet":
        """The first TRAIN Data layer of a net prototxt (a relative mean_file stays as
        written: give an absolute one, or run where it resolves)."""
        net = caffe_pb2.NetParameter()
        try:
            text_format.Parse(Path(path).read_text(), net)
        except (OSError, text_format.ParseError) as e:
            raise ValueError(f"--net {path}: {e}") from None
        for layer in net.layer:
            phases = {rule.phase for rule in layer.include if rule.HasField("phase")}
            if layer.type == "Data" and (not phases or caffe_pb2.TRAIN in phases):
                return cls(int(layer.data_param.batch_size),
                           text_format.MessageToString(layer.transform_param, as_one_line=True))
        raise ValueError(f"--net {path}: no Data layer in the TRAIN phase")

    def prototxt(self, db: Path, decoders: int | None) -> str:
        """The data-only net; ``decoders`` None: Caffe's (no Poseidon fields)."""
        extra = f" decoders: {decoders}" if decoders is not None else ""
        return (f'name: "data_only"\n'
                f'layer {{ name: "data" type: "Data" top: "data" top: "label"\n'
                f'  transform_param {{ {self.transform} }}\n'
                f'  data_param {{ source: "{db}" batch_size: {self.batch} backend: LMDB{extra} }} }}\n'
                f'layer {{ name: "silence" type: "Silence" bottom: "data" bottom: "label" }}\n')


def sample_pictures(n: int = SAMPLE_RECORDS, size: int = SAMPLE_SIZE):
    """``n`` RGB size x size pictures cut from scikit-learn's sample photographs at seeded
    random places and scales (an iterator of HWC uint8 arrays)."""
    import numpy as np
    from PIL import Image
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:
        raise RuntimeError("the sample databases are cut from scikit-learn's sample photos: "
                           "pip install scikit-learn, or give --db") from None
    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    for i in range(n):
        photo = photos[i % len(photos)]
        side = int(rng.integers(size * 3 // 4, min(photo.shape[:2]) + 1))
        y = int(rng.integers(photo.shape[0] - side + 1))
        x = int(rng.integers(photo.shape[1] - side + 1))
        yield np.asarray(Image.fromarray(photo[y:y + side, x:x + side]).resize(
            (size, size), Image.BILINEAR))


def make_sample_dbs(folder: Path) -> dict[str, Path]:
    """The raw and the JPEG LMDB of the sample pictures in ``folder``."""
    import numpy as np
    from PIL import Image

    from engine.data.datum import array_to_datum
    from engine.data.lmdb_source import write_lmdb
    raw, jpeg = [], []
    for i, rgb in enumerate(sample_pictures()):
        key = f"{i:08d}".encode()
        chw = np.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))  # Caffe's BGR
        raw.append((key, array_to_datum(chw, i % 1000).SerializeToString()))
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
        jpeg.append((key, caffe_pb2.Datum(data=buf.getvalue(), label=i % 1000,
                                          encoded=True).SerializeToString()))
    dbs = {"raw": folder / "raw_lmdb", "jpeg": folder / "jpeg_lmdb"}
    write_lmdb(dbs["raw"], raw)
    write_lmdb(dbs["jpeg"], jpeg)
    return dbs


def _env() -> dict[str, str]:
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def _poseidon(proto: Path, iters: int) -> tuple[float, dict[str, float]]:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(proto), str(iters)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"poseidon on {proto.name}: {done.stderr.strip().splitlines()[-1:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return float(out["ms"]), out["stats"]


@dataclass
class _Runs:
    ms: list[float] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    failed: str = ""


def run(dbs: dict[str, Path], decoders: list[int], net: DataNet, iterations: int,
        repeats: int, caffe: str | None, folder: Path,
        say: Callable[[str], None] = print) -> dict[str, Any]:
    """Time every database with each decoder count, and Caffe beside them; the JSON report."""
    protos: dict[tuple[str, str], Path] = {}
    for name, db in dbs.items():
        for d in decoders:
            protos[name, f"poseidon-{d}"] = folder / f"{name}_d{d}.prototxt"
            protos[name, f"poseidon-{d}"].write_text(net.prototxt(db, d))
        if caffe:
            protos[name, "caffe"] = folder / f"{name}_caffe.prototxt"
            protos[name, "caffe"].write_text(net.prototxt(db, None))
    runs = {key: _Runs() for key in protos}
    for _ in range(repeats):
        for key, proto in protos.items():  # alternate
            r = runs[key]
            if r.failed:
                continue
            if key[1] == "caffe":
                try:
                    ms, _ = caffe_time(caffe, proto, iterations, 1)
                except RuntimeError as e:
                    r.failed = str(e)
                    continue
                r.ms.append(ms)
            else:
                ms, stats = _poseidon(proto, iterations)
                r.ms.append(ms)
                r.stats.append(stats)
    return {"batch": net.batch, "transform_param": net.transform, "iterations": iterations,
            "repeats": repeats, "decoders": decoders,
            "databases": {name: _summary(name, {k[1]: runs[k] for k in runs if k[0] == name},
                                         net.batch, decoders, say) for name in dbs}}


def _summary(name: str, runs: dict[str, _Runs], batch: int, decoders: list[int],
             say: Callable[[str], None]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    base = None
    for peer, r in runs.items():
        if r.failed:
            res[peer] = {"failed": r.failed}
            say(f"{name:6} {peer:11} failed: {r.failed}")
            continue
        med = statistics.median(r.ms)
        entry: dict[str, Any] = {"runs_ms": r.ms, "median_ms": med,
                                 "images_per_s": batch * 1000 / med}
        if r.stats:
            entry["per_batch_ms"] = {
                part: statistics.median(s[f"{part}_s"] * 1000 / s["batches"] for s in r.stats)
                for part in ("read", "decode", "transform", "wait")}
        res[peer] = entry
    line = []
    one = res.get(f"poseidon-{decoders[0]}")
    if one and "median_ms" in one:
        base = one["images_per_s"]
    for d in decoders:
        e = res.get(f"poseidon-{d}")
        if e is None or "median_ms" not in e:
            continue
        e["speedup_vs_first"] = e["images_per_s"] / base if base else None
        p = e["per_batch_ms"]
        say(f"{name:6} poseidon {d} decoder{'s' if d > 1 else ' '} {e['median_ms']:8.1f} ms/batch "
            f"{e['images_per_s']:7.0f} images/s ({e['speedup_vs_first']:.2f}x {decoders[0]}) "
            f"read {p['read']:.1f} decode {p['decode']:.1f} transform {p['transform']:.1f} "
            f"wait {p['wait']:.1f} ms")
        line.append(e)
    c = res.get("caffe")
    if c and "median_ms" in c:
        say(f"{name:6} caffe               {c['median_ms']:8.1f} ms/batch "
            f"{c['images_per_s']:7.0f} images/s")
        for d in decoders:
            e = res.get(f"poseidon-{d}")
            if e and "median_ms" in e:
                e["ratio_vs_caffe"] = e["median_ms"] / c["median_ms"]
                say(f"{name:6} poseidon {d} decoder{'s' if d > 1 else ' '} / caffe: "
                    f"{e['ratio_vs_caffe']:.2f}x the time")
    return res


def with_sample_dbs(dbs: dict[str, Path] | None, fn: Callable[[dict[str, Path], Path], Any]
                    ) -> Any:
    """Call ``fn(dbs, scratch folder)``, making the sample databases when ``dbs`` is None."""
    with tempfile.TemporaryDirectory(prefix="poseidon-bench-data-") as tmp:
        folder = Path(tmp)
        return fn(dbs if dbs is not None else make_sample_dbs(folder), folder)
