"""Decoding workers: one decoder or several give the same batches, bit for bit, for raw and
JPEG records with crop, mirror and mean (and ImageData, WindowData); a corrupt JPEG in an LMDB
is named by key and position and skipped, or stops a strict run; the threads end on close,
on a dropped layer, and a SIGINT ends a process that is decoding."""
from __future__ import annotations

import contextlib
import io
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import Image

from engine import backend
from engine.data.datum import decode_image
from engine.data.decoders import DecoderPool, default_decoders
from engine.data.lmdb_source import write_lmdb
from engine.data.transformer import crop_draws, read_mean_file, write_mean_file
from engine.layers.base import LayerError
from engine.pb import caffe_pb2
from tests.conftest import ROOT
from tests.test_data import make_layer, run
from tests.test_data_window_hdf5out import batches, pictures, window_layer  # noqa: F401

N, H, W = 13, 16, 18  # 13 records: batches of 5 wrap around the database


def smooth_pictures(n: int = N) -> np.ndarray:
    """``n`` RGB pictures (HWC uint8) with gradients and noise: JPEG keeps them distinct."""
    rng = np.random.default_rng(4)
    y, x = np.mgrid[:H, :W]
    out = []
    for i in range(n):
        base = (np.stack([x * (i + 3), y * (i + 5), (x + y) * 7], axis=-1) + i * 19) % 256
        out.append(np.clip(base + rng.integers(-20, 21, base.shape), 0, 255).astype(np.uint8))
    return np.stack(out)


def jpeg(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A raw and a JPEG LMDB of the same pictures (labels 0..N-1), and a mean file."""
    folder = tmp_path_factory.mktemp("decoders")
    pics = smooth_pictures()
    raw, enc = [], []
    for i, rgb in enumerate(pics):
        chw = np.ascontiguousarray(rgb[:, :, ::-1].transpose(2, 0, 1))
        raw.append((b"%03d" % i, caffe_pb2.Datum(channels=3, height=H, width=W, label=i,
                                                 data=chw.tobytes()).SerializeToString()))
        enc.append((b"%03d" % i, caffe_pb2.Datum(label=i, encoded=True,
                                                 data=jpeg(rgb)).SerializeToString()))
    write_lmdb(folder / "raw", raw)
    write_lmdb(folder / "jpeg", enc)
    mean = np.random.default_rng(5).uniform(0, 255, (3, H, W)).astype(np.float32)
    write_mean_file(folder / "mean.binaryproto", mean)
    return {"raw": folder / "raw", "jpeg": folder / "jpeg", "mean": folder / "mean.binaryproto"}


def data_layer(db: Path, decoders: int, prefetch: int, transform: str, extra: str = ""):
    return make_layer(f"""name: "d" type: "Data" top: "data" top: "label"
        transform_param {{ {transform} }}
        data_param {{ source: "{db}" batch_size: 5 backend: LMDB decoders: {decoders}
                      prefetch: {prefetch} {extra} }}""", "TRAIN")


def reference(db: str, pics: np.ndarray, seed: int, k: int, mean: np.ndarray,
              scale: float) -> np.ndarray:
    """Record k's transformed pixels, computed here from Pillow's own decoding: Caffe's
    (pixel - mean) * scale at the crop, then the mirror, with crop_draws' words."""
    rgb = pics[k % N] if db == "raw" else np.asarray(Image.open(io.BytesIO(jpeg(pics[k % N]))))
    x = (rgb[:, :, ::-1].transpose(2, 0, 1).astype(np.float32) - mean) * np.float32(scale)
    word = [int(v) for v in crop_draws(seed, np.array([k]))[0]]
    h0, w0 = ((word[1] >> 32) * (H - 12 + 1)) >> 32, ((word[2] >> 32) * (W - 12 + 1)) >> 32
    x = x[:, h0:h0 + 12, w0:w0 + 12]
    return x[:, :, ::-1] if word[0] >> 63 else x


@pytest.mark.parametrize("db", ["raw", "jpeg"])
@pytest.mark.parametrize("mean", ["values", "file"])
def test_decoders_give_the_same_batches_bit_for_bit(dbs, db: str, mean: str) -> None:
    means = ("mean_value: 104 mean_value: 117 mean_value: 123" if mean == "values"
             else f'mean_file: "{dbs["mean"]}"')
    transform = f"crop_size: 12 mirror: true scale: 0.5 {means}"
    got = {}
    for decoders, prefetch in ((1, 0), (2, 0), (3, 3), (4, 1)):
        backend.seed(7)  # the layer's seed for its crops
        layer, tops = data_layer(dbs[db], decoders, prefetch, transform)
        assert layer.decoders == decoders
        got[decoders, prefetch] = run(layer, tops, 6)  # 30 records: more than two passes
        seed = layer._seed
        layer.close()
    first = got[1, 0]
    for key, batches_ in got.items():
        for (d1, l1), (d2, l2) in zip(first, batches_):
            assert d1.tobytes() == d2.tobytes() and l1.tobytes() == l2.tobytes(), key
    # and they are the right pixels: independently decoded, cropped, mirrored, centred
    pics = smooth_pictures()
    m = (np.array([104, 117, 123], np.float32).reshape(3, 1, 1) if mean == "values"
         else read_mean_file(dbs["mean"]))
    flips = set()
    for b, (data, labels) in enumerate(first):
        for row in range(5):
            k = b * 5 + row
            np.testing.assert_array_equal(data[row], reference(db, pics, seed, k, m, 0.5))
            assert labels[row] == k % N
            flips.add(bool(int(crop_draws(seed, np.array([k]))[0, 0]) >> 63))
    assert flips == {True, False}


def test_image_data_and_window_data_decoders_agree(tmp_path: Path, pictures) -> None:  # noqa: F811
    got = []
    for decoders in (1, 3):
        backend.seed(7)
        layer, tops = window_layer(tmp_path, transform="crop_size: 4 mirror: true",
                                   params="context_pad: 1", prefetch=2, decoders=decoders)
        assert layer.decoders == decoders
        got.append(batches(layer, tops, 4))
        layer.close()
    for (a, la), (b, lb) in zip(*got):
        assert a.tobytes() == b.tobytes() and la.tobytes() == lb.tobytes()

    pics = smooth_pictures(7)
    (tmp_path / "imgs").mkdir()
    for i, rgb in enumerate(pics):
        Image.fromarray(rgb).save(tmp_path / "imgs" / f"{i}.jpg", quality=90)
    (tmp_path / "list.txt").write_text("".join(f"{i}.jpg {i}\n" for i in range(7)))
    out = []
    for decoders in (1, 2):
        backend.seed(7)
        layer, tops = make_layer(f"""name: "img" type: "ImageData" top: "data" top: "label"
            transform_param {{ crop_size: 10 mirror: true mean_value: 50 }}
            image_data_param {{ source: "{tmp_path / 'list.txt'}" root_folder: "{tmp_path}/imgs/"
                                batch_size: 3 shuffle: true }}
            data_param {{ decoders: {decoders} prefetch: 2 }}""", "TRAIN")
        out.append(run(layer, tops, 5))
        layer.close()
    for (a, la), (b, lb) in zip(*out):
        assert a.tobytes() == b.tobytes() and la.tobytes() == lb.tobytes()


@contextlib.contextmanager
def glog_records() -> Iterator[list[logging.LogRecord]]:
    """The records glog writes meanwhile (its loggers do not propagate to the root, where
    pytest's caplog listens in older pytest versions)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("engine")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("decoders", [1, 2])
def test_a_corrupt_jpeg_is_named_and_skipped_or_stops_a_strict_run(tmp_path, decoders):
    pics = smooth_pictures(6)
    records = [(b"img%d" % i, caffe_pb2.Datum(label=i, encoded=True, data=jpeg(p)))
               for i, p in enumerate(pics)]
    records[3][1].data = records[3][1].data[:len(records[3][1].data) // 2]  # truncated
    write_lmdb(tmp_path / "db", [(k, d.SerializeToString()) for k, d in records])
    transform = "mirror: true"
    with glog_records() as logged:
        layer, tops = data_layer(tmp_path / "db", decoders, 2, transform)
        got = run(layer, tops, 3)  # record 3 is at stream positions 3 and 9
        layer.close()
    warnings = [r.getMessage() for r in logged if "skipping" in r.getMessage()]
    assert len(warnings) == 1  # named once, not on every pass
    assert ("layer 'd': skipping corrupt record 3 (key b'img3', stream position 3) in "
            in warnings[0]) and "cannot decode image" in warnings[0]
    # row 3 holds the next record (4), with row 3's own mirror draw
    decoded = np.asarray(Image.open(io.BytesIO(jpeg(pics[4]))))
    want = decoded[:, :, ::-1].transpose(2, 0, 1).astype(np.float32)
    flip = int(crop_draws(layer._seed, np.array([3]))[0, 0]) >> 63
    np.testing.assert_array_equal(got[0][0][3], want[:, :, ::-1] if flip else want)
    np.testing.assert_array_equal(got[0][1], [0, 1, 2, 4, 4])
    np.testing.assert_array_equal(got[1][1], [5, 0, 1, 2, 4])  # position 9: record 3 again
    assert layer.stats.skipped == 2

    layer, tops = data_layer(tmp_path / "db", decoders, 2, transform, extra="strict: true")
    with pytest.raises(LayerError, match=r"layer 'd' \(Data\): corrupt record 3 \(key b'img3', "
                                         r"stream position 3\) in .*db: cannot decode image "
                                         r".*\(data_param.strict\)"):
        layer.forward([], tops)
    layer.close()


def decoder_threads(name: str = "decode 'd'") -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


def test_decoder_threads_end_on_close_and_with_a_dropped_layer(dbs) -> None:
    import gc
    layer, tops = data_layer(dbs["jpeg"], 3, 2, "crop_size: 12")
    run(layer, tops, 2)
    assert len(decoder_threads()) == 3
    layer.close()
    assert decoder_threads() == []
    layer.close()  # idempotent
    layer, tops = data_layer(dbs["jpeg"], 2, 2, "crop_size: 12")
    run(layer, tops, 1)
    del layer, tops
    gc.collect()
    deadline = time.monotonic() + 30  # liveness bound: the threads see their stop at once
    while decoder_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decoder_threads() == []


def test_a_pool_runs_every_job_and_hands_back_the_first_error() -> None:
    for threads in (0, 3):
        pool = DecoderPool(threads)
        seen = []
        pool.run([lambda i=i: seen.append(i) for i in range(50)]).wait(30)
        assert sorted(seen) == list(range(50))

        def boom() -> None:
            raise ValueError("job 7 failed")
        with pytest.raises(ValueError, match="job 7 failed"):
            pool.run([lambda: None, boom, lambda: None]).wait(30)
        pool.close()
    assert 1 <= default_decoders() <= 4


def test_direct_jpeg_decoding_equals_pillows_own(tmp_path: Path) -> None:
    pics = smooth_pictures(4)
    for i, rgb in enumerate(pics):
        for kwargs in ({}, {"progressive": True}, {"subsampling": 0}):
            buf = io.BytesIO()
            Image.fromarray(rgb).save(buf, format="JPEG", quality=80, **kwargs)
            img = Image.open(io.BytesIO(buf.getvalue()))
            want = np.asarray(img.convert("RGB"))[:, :, ::-1]
            np.testing.assert_array_equal(decode_image(buf.getvalue()), want)
            np.testing.assert_array_equal(decode_image(buf.getvalue(), color=False)[:, :, 0],
                                          np.asarray(img.convert("L")))
        grey = io.BytesIO()
        Image.fromarray(rgb[:, :, 0]).save(grey, format="JPEG")
        g = np.asarray(Image.open(io.BytesIO(grey.getvalue())))
        np.testing.assert_array_equal(decode_image(grey.getvalue())[:, :, 0], g)
        np.testing.assert_array_equal(decode_image(grey.getvalue(), color=True),
                                      np.repeat(g[:, :, None], 3, axis=2))


_DECODING_FOREVER = r"""
import sys
from engine.net import Net
net = Net(sys.argv[1], phase="TRAIN")
print("decoding", flush=True)
while True:
    net.forward()
"""


def test_sigint_ends_a_process_that_is_decoding(dbs, tmp_path: Path) -> None:
    proto = tmp_path / "net.prototxt"
    proto.write_text(f"""layer {{ name: "d" type: "Data" top: "data" top: "label"
        transform_param {{ crop_size: 12 mirror: true }}
        data_param {{ source: "{dbs['jpeg']}" batch_size: 5 backend: LMDB decoders: 3 }} }}""")
    proc = subprocess.Popen([sys.executable, "-c", _DECODING_FOREVER, str(proto)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "decoding"
        time.sleep(0.5)  # decoding under way
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)  # a liveness bound, not a speed claim
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err


def test_default_decoders_one_for_raw_records_more_for_encoded(dbs) -> None:
    for db, want in (("raw", 1), ("jpeg", default_decoders())):
        layer, _ = data_layer(dbs[db], 0, 0, "crop_size: 12")
        assert layer.decoders == want
        layer.close()
