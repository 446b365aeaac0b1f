"""Data: Caffe LMDBs of Datum, converters, the transformer, the data layers, prefetch, CLI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from google.protobuf import text_format

import engine.layer_types  # noqa: F401  (fills the registry, data layers included)
from engine import backend
from engine.blob import Blob
from engine.context import RunContext
from engine.data import converters
from engine.data.datum import (
    DataError,
    array_to_datum,
    datum_to_array,
    encode_image,
    parse_datum,
)
from engine.data.lmdb_source import open_db, write_lmdb
from engine.data.prefetch import Prefetcher
from engine.data.transformer import (
    DataTransformer,
    crop_draws,
    read_mean_file,
    write_mean_file,
)
from engine.layers.base import LayerError, create_layer
from engine.pb import caffe_pb2
from tests.conftest import ROOT, shared_path

# -- helpers -------------------------------------------------------------------------------

def make_layer(text: str, phase: str = "TRAIN", base: Path | None = None, rank: int = 0,
               world: int = 1, ntop: int = 2):
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    layer = create_layer(param, phase)
    layer.context = RunContext(rank, world, [base] if base else [])
    tops = [Blob() for _ in range(ntop)]
    layer.setup([], tops)
    layer.reshape([], tops)
    return layer, tops


def data_layer(source: Path, batch: int, phase: str = "TRAIN", extra: str = "",
               transform: str = "", prefetch: int = 0, **kw):
    return make_layer(f"""name: "d" type: "Data" top: "data" top: "label"
        transform_param {{ {transform} }}
        data_param {{ source: "{source}" batch_size: {batch} backend: LMDB
                      prefetch: {prefetch} {extra} }}""", phase, **kw)


def run(layer, tops, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for _ in range(n):
        layer.forward([], tops)
        out.append((tops[0].data.copy(), tops[1].data.copy()))
    return out


@pytest.fixture
def small_db(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """An LMDB of 10 distinct 1x4x5 images with labels 0..9."""
    images = (np.arange(10 * 20).reshape(10, 1, 4, 5) % 251).astype(np.uint8)
    labels = np.arange(10)
    converters.write_images(tmp_path / "small_lmdb", images, labels)
    return tmp_path / "small_lmdb", images, labels


@pytest.fixture
def mnist_dir() -> Path:
    return shared_path("data", "mnist")


# -- reading Caffe's own LMDB ------------------------------------------------------------------

def test_reads_caffe_lmdb_matching_idx_files(mnist_dir: Path) -> None:
    db = open_db(shared_path("fixtures", "oracle", "train", "mnist_train_lmdb"))
    images, labels = converters.load_idx_pair(mnist_dir, "train", limit=300)
    assert len(db) == 12800
    try:
        for k in (0, 1, 2, 150, 299):
            key, value = db.get(k)
            datum = parse_datum(value)
            assert key == f"{k:08d}".encode()
            assert datum.label == labels[k]
            np.testing.assert_array_equal(datum_to_array(datum), images[k])
        assert db.get(12800)[0] == b"00000000"  # the stream wraps around
    finally:
        db.close()


def test_mnist_converter_is_byte_identical_to_caffe(mnist_dir: Path, tmp_path: Path) -> None:
    counts = converters.convert_mnist(mnist_dir, tmp_path, limit=200)
    assert counts == {"mnist_train_lmdb": 200, "mnist_test_lmdb": 200}
    for split in ("train", "test"):
        ours = open_db(tmp_path / f"mnist_{split}_lmdb")
        caffe = open_db(shared_path("fixtures", "oracle", "train", f"mnist_{split}_lmdb"))
        assert all(ours.get(k) == caffe.get(k) for k in range(200))
        ours.close(), caffe.close()


def test_caffe_lmdb_through_the_data_layer(mnist_dir: Path) -> None:
    src = shared_path("fixtures", "oracle", "train", "mnist_test_lmdb")
    layer, tops = data_layer(src, 100, "TEST", transform="scale: 0.00390625")
    images, labels = converters.load_idx_pair(mnist_dir, "test", limit=100)
    layer.forward([], tops)
    assert tops[0].shape == (100, 1, 28, 28) and tops[1].shape == (100,)
    np.testing.assert_array_equal(tops[0].data, images.astype(np.float32) * np.float32(1 / 256))
    np.testing.assert_array_equal(tops[1].data, labels.astype(np.float32))
    layer.close()


# -- writing and converting -----------------------------------------------------------------------

def test_round_trip_raw_float_and_encoded(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    color = rng.integers(0, 256, (3, 6, 7), dtype=np.uint8)
    grey = rng.integers(0, 256, (1, 5, 4), dtype=np.uint8)
    floats = rng.standard_normal((2, 3, 3)).astype(np.float32)
    records = [(b"a", array_to_datum(color, 3).SerializeToString()),
               (b"b", array_to_datum(color, 4, encode="PNG").SerializeToString()),
               (b"c", array_to_datum(grey, 5, encode="PNG").SerializeToString()),
               (b"d", array_to_datum(floats, 6).SerializeToString())]
    assert write_lmdb(tmp_path / "db", records) == 4
    db = open_db(tmp_path / "db")
    got = [parse_datum(db.get(k)[1]) for k in range(4)]
    db.close()
    assert [d.label for d in got] == [3, 4, 5, 6]
    assert got[1].encoded and got[2].encoded
    np.testing.assert_array_equal(datum_to_array(got[0]), color)
    np.testing.assert_array_equal(datum_to_array(got[1]), color)  # BGR kept through PNG
    np.testing.assert_array_equal(datum_to_array(got[2]), grey)
    np.testing.assert_array_equal(datum_to_array(got[3]), floats)
    assert datum_to_array(got[2], color=True).shape == (3, 5, 4)  # force_color
    with pytest.raises(DataError, match="already exists"):
        write_lmdb(tmp_path / "db", records)


def test_cifar_converter(tmp_path: Path) -> None:
    src = shared_path("data", "cifar10-subset")
    counts = converters.convert_cifar10(src, tmp_path)
    assert counts == {"cifar10_train_lmdb": 4000, "cifar10_test_lmdb": 1000}
    raw = np.fromfile(src / "test_batch.bin", dtype=np.uint8, count=3 * 3073).reshape(3, 3073)
    db = open_db(tmp_path / "cifar10_test_lmdb")
    for k in range(3):
        key, value = db.get(k)
        datum = parse_datum(value)
        assert key == f"{k:05d}".encode() and datum.label == raw[k, 0]
        assert (datum.channels, datum.height, datum.width) == (3, 32, 32)
        assert datum.data == raw[k, 1:].tobytes()
    db.close()


def test_digits_and_mean(tmp_path: Path) -> None:
    counts = converters.convert_digits(tmp_path)
    assert counts == {"digits_train_lmdb": 1500, "digits_test_lmdb": 297}
    images, labels = converters.digits_arrays()
    assert images.dtype == np.uint8 and images.max() == 255 and images.shape == (1797, 1, 8, 8)
    mean, n = converters.compute_image_mean(tmp_path / "digits_test_lmdb")
    assert n == 297
    np.testing.assert_allclose(mean, images[1500:].astype(np.float64).mean(axis=0), rtol=1e-6)
    write_mean_file(tmp_path / "mean.binaryproto", mean)
    np.testing.assert_array_equal(read_mean_file(tmp_path / "mean.binaryproto"), mean)


def test_read_idx_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x03\x00\x00\x00\x05")
    with pytest.raises(DataError, match="header says"):
        converters.read_idx(tmp_path / "bad")


# -- the transformer --------------------------------------------------------------------------------

def transform_param(text: str) -> caffe_pb2.TransformationParameter:
    return text_format.Parse(text, caffe_pb2.TransformationParameter())


def test_transformer_scale_and_mean_value() -> None:
    img = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(1, 2, 3, 4)
    t = DataTransformer(transform_param("scale: 0.5 mean_value: 3 mean_value: 10"), "TRAIN")
    out = t.transform(img)
    expect = (img.astype(np.float32) - np.array([3, 10], np.float32).reshape(1, 2, 1, 1)) * 0.5
    np.testing.assert_array_equal(out, expect)
    one = DataTransformer(transform_param("mean_value: 2"), "TEST").transform(img)
    np.testing.assert_array_equal(one, img - np.float32(2))


def test_transformer_mean_file_before_centre_crop(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (1, 2, 6, 6), dtype=np.uint8)
    mean = rng.uniform(0, 255, (2, 6, 6)).astype(np.float32)
    write_mean_file(tmp_path / "m.binaryproto", mean)
    t = DataTransformer(transform_param('crop_size: 4 scale: 0.25 mean_file: "m"'), "TEST",
                        tmp_path / "m.binaryproto")
    out = t.transform(img)
    # Caffe: (pixel[c, h_off+h, w_off+w] - mean[c, h_off+h, w_off+w]) * scale, h_off = (6-4)//2
    expect = (img[0, :, 1:5, 1:5].astype(np.float32) - mean[:, 1:5, 1:5]) * np.float32(0.25)
    np.testing.assert_array_equal(out[0], expect)
    assert t.output_shape((2, 6, 6)) == (2, 4, 4)


def test_transformer_random_crop_and_mirror_follow_the_draws() -> None:
    img = np.arange(3 * 5 * 5, dtype=np.uint8).reshape(1, 3, 5, 5)
    t = DataTransformer(transform_param("crop_size: 3 mirror: true"), "TRAIN")
    draws = crop_draws(7, np.arange(40))
    for i in range(40):
        word = [int(v) for v in draws[i]]
        flip = bool(word[0] >> 63)
        h0, w0 = ((word[1] >> 32) * 3) >> 32, ((word[2] >> 32) * 3) >> 32
        crop = img[0, :, h0:h0 + 3, w0:w0 + 3].astype(np.float32)
        np.testing.assert_array_equal(t.transform(img, draws[i:i + 1])[0],
                                      crop[:, :, ::-1] if flip else crop)
    # the words are a function of (seed, index) alone; over 40 indices every offset and
    # both mirror states occur
    np.testing.assert_array_equal(crop_draws(7, np.arange(20, 40)), draws[20:])
    assert not np.array_equal(crop_draws(8, np.arange(40)), draws)
    outs = {t.transform(img, draws[i:i + 1]).tobytes() for i in range(40)}
    assert len(outs) > 10
    assert {bool(int(w) >> 63) for w in draws[:, 0]} == {False, True}


def test_transformer_mirrored_random_crop_indexes_the_mean_file_at_input_positions(tmp_path):
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (1, 3, 7, 9), dtype=np.uint8)
    mean = rng.uniform(0, 255, (3, 7, 9)).astype(np.float32)
    write_mean_file(tmp_path / "m.binaryproto", mean)
    t = DataTransformer(transform_param('crop_size: 4 mirror: true scale: 0.5 mean_file: "m"'),
                        "TRAIN", tmp_path / "m.binaryproto")
    draws = crop_draws(3, np.arange(30))
    seen = set()
    for i in range(30):
        word = [int(v) for v in draws[i]]
        flip = bool(word[0] >> 63)
        h0, w0 = ((word[1] >> 32) * 4) >> 32, ((word[2] >> 32) * 6) >> 32
        # Caffe: top[c, h, W-1-w] = (pixel[c, h0+h, w0+w] - mean[c, h0+h, w0+w]) * scale
        x = (img[0].astype(np.float32) - mean)[:, h0:h0 + 4, w0:w0 + 4] * np.float32(0.5)
        np.testing.assert_array_equal(t.transform(img, draws[i:i + 1])[0],
                                      x[:, :, ::-1] if flip else x)
        seen.add((flip, w0 == 0))
    assert (True, True) in seen  # a mirrored crop at column 0 (the slice that ends at None)


def test_transformer_errors(tmp_path: Path) -> None:
    write_mean_file(tmp_path / "m.binaryproto", np.zeros((1, 4, 4), np.float32))
    t = DataTransformer(transform_param('mean_file: "m"'), "TEST", tmp_path / "m.binaryproto")
    with pytest.raises(DataError, match=r"mean file .*m.binaryproto has shape \(1, 4, 4\) but the "
                                        r"data is \(3, 8, 8\)"):
        t.output_shape((3, 8, 8))
    with pytest.raises(DataError, match="mean_file and mean_value"):
        DataTransformer(transform_param('mean_file: "m" mean_value: 1'), "TEST")
    with pytest.raises(DataError, match="1 mean_value or as many as channels"):
        DataTransformer(transform_param("mean_value: 1 mean_value: 2"), "TEST").output_shape((3, 2, 2))
    with pytest.raises(DataError, match="crop_size 9 is larger"):
        DataTransformer(transform_param("crop_size: 9"), "TEST").output_shape((1, 8, 8))


# -- the Data layer -------------------------------------------------------------------------------

def test_data_layer_batches_in_order_with_wrap_around(small_db) -> None:
    path, images, labels = small_db
    layer, tops = data_layer(path, 4)
    batches = run(layer, tops, 3)  # records 0-3, 4-7, 8 9 0 1
    order = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), labels[order])
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), images[order])
    assert layer.position() == 12
    layer.close()


def test_data_layer_single_top_and_float64_blobs(small_db) -> None:
    path, images, _ = small_db
    param = text_format.Parse(f"""name: "d" type: "Data" top: "data"
        data_param {{ source: "{path}" batch_size: 2 backend: LMDB }}""", caffe_pb2.LayerParameter())
    layer = create_layer(param, "TEST")
    top = [Blob(dtype=np.float64)]
    layer.setup([], top)
    layer.forward([], top)
    assert top[0].data.dtype == np.float64
    np.testing.assert_array_equal(top[0].data, images[:2])
    layer.close()


@pytest.mark.parametrize("world", [2, 3])
def test_rank_striding_union_equals_single_worker(small_db, world: int) -> None:
    path, _, _ = small_db
    b = 2
    single, stops = data_layer(path, world * b)
    workers = [data_layer(path, b, rank=r, world=world) for r in range(world)]
    for _ in range(4):  # crosses the end of the 10 records
        single.forward([], stops)
        parts = []
        for layer, tops in workers:
            layer.forward([], tops)
            parts.append((tops[0].data.copy(), tops[1].data.copy()))
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), stops[0].data)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), stops[1].data)
        assert {layer.position() for layer, _ in workers} == {single.position()}
    # TEST nets are not strided: every worker reads the whole stream
    test0, t0 = data_layer(path, b, "TEST", rank=0, world=world)
    test1, t1 = data_layer(path, b, "TEST", rank=1, world=world)
    test0.forward([], t0), test1.forward([], t1)
    np.testing.assert_array_equal(t0[1].data, t1[1].data)
    for layer, _ in [*workers, (single, None), (test0, None), (test1, None)]:
        layer.close()


def test_random_crops_do_not_depend_on_the_number_of_workers(small_db) -> None:
    path, _, _ = small_db
    transform = "crop_size: 3 mirror: true"
    backend.seed(5)
    single, stops = data_layer(path, 4, transform=transform)
    workers = []
    for r in range(2):
        backend.seed(5)  # every worker is seeded with the solver's random_seed
        workers.append(data_layer(path, 2, transform=transform, rank=r, world=2))
    for _ in range(3):
        single.forward([], stops)
        parts = [run(layer, tops, 1)[0][0] for layer, tops in workers]
        np.testing.assert_array_equal(np.concatenate(parts), stops[0].data)


def test_shared_file_system_false_reads_source_k(small_db, tmp_path: Path) -> None:
    path, images, labels = small_db
    converters.write_images(tmp_path / "small_lmdb_1", images[::-1].copy(), labels[::-1].copy())
    layer, tops = data_layer(path, 3, extra="shared_file_system: false", rank=1, world=2)
    assert layer.source == tmp_path / "small_lmdb_1" or layer.source.name == "small_lmdb_1"
    run(layer, tops, 1)
    np.testing.assert_array_equal(tops[1].data, [9, 8, 7])
    assert layer.position() == 3
    layer.close()


def test_position_and_seek_resume_exactly(small_db) -> None:
    path, _, _ = small_db
    transform = "crop_size: 3 mirror: true"
    backend.seed(3)
    straight, t1 = data_layer(path, 3, transform=transform, prefetch=2)
    expected = run(straight, t1, 6)
    backend.seed(3)
    first, t2 = data_layer(path, 3, transform=transform, prefetch=2)
    run(first, t2, 3)
    saved = first.position()
    assert saved == 9
    run(first, t2, 1)  # the run goes on past the snapshot ...
    backend.seed(3)
    resumed, t3 = data_layer(path, 3, transform=transform, prefetch=2)
    run(resumed, t3, 1)  # ... and a fresh net has already prefetched from the start
    resumed.seek(saved)
    got = run(resumed, t3, 3)
    for (a, la), (b, lb) in zip(expected[3:], got):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    first.seek(saved)
    np.testing.assert_array_equal(run(first, t2, 1)[0][0], expected[3][0])
    for layer in (straight, first, resumed):
        layer.close()


def test_prefetch_gives_the_same_sequence(small_db) -> None:
    path, _, _ = small_db
    backend.seed(11)
    plain, t1 = data_layer(path, 3, transform="crop_size: 2 mirror: true", prefetch=0)
    backend.seed(11)
    ahead, t2 = data_layer(path, 3, transform="crop_size: 2 mirror: true", prefetch=4)
    for (a, la), (b, lb) in zip(run(plain, t1, 8), run(ahead, t2, 8)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    plain.close(), ahead.close()


def test_prefetcher_order_errors_and_close() -> None:
    def load(pos: int) -> int:
        if pos == 30:
            raise DataError("boom at 30")
        return pos * 2
    p = Prefetcher(load, 0, 10, depth=2)
    assert [p.get() for _ in range(3)] == [(0, 0), (10, 20), (20, 40)]
    with pytest.raises(DataError, match="boom"):
        p.get()
    p.reset(100)
    assert p.get() == (100, 200)
    p.close()
    p.close()


def test_rand_skip_starts_below_the_bound(small_db) -> None:
    path, _, labels = small_db
    backend.seed(2)
    layer, tops = data_layer(path, 2, extra="rand_skip: 7")
    start = layer.position()
    assert 0 <= start < 7
    run(layer, tops, 1)
    np.testing.assert_array_equal(tops[1].data, labels[[start % 10, (start + 1) % 10]])
    layer.close()


def test_encoded_records_and_force_gray(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (3, 3, 4, 4), dtype=np.uint8)
    converters.write_images(tmp_path / "enc_lmdb", images, [0, 1, 2], encode="PNG")
    layer, tops = data_layer(tmp_path / "enc_lmdb", 3, "TEST")
    run(layer, tops, 1)
    np.testing.assert_array_equal(tops[0].data, images)
    layer.close()
    grey, gtops = data_layer(tmp_path / "enc_lmdb", 3, "TEST", transform="force_gray: true")
    assert gtops[0].shape == (3, 1, 4, 4)
    grey.close()


# -- errors ----------------------------------------------------------------------------------------

def test_missing_lmdb_names_path_and_command(tmp_path: Path) -> None:
    with pytest.raises(LayerError, match=r"layer 'd' \(Data\): LMDB not found: .*mnist_train_lmdb "
                                         r"\(make it with `poseidon data mnist --out "):
        data_layer(tmp_path / "mnist_train_lmdb", 4)
    with pytest.raises(LayerError, match="poseidon data cifar10"):
        data_layer(tmp_path / "cifar10_test_lmdb", 4)
    # a database of one's own images: the converter, with where it would go
    with pytest.raises(LayerError) as e:
        data_layer(tmp_path / "ilsvrc12_train_lmdb", 4)
    assert f"LMDB not found: {tmp_path / 'ilsvrc12_train_lmdb'} (make it" in str(e.value)
    assert (f"make it from your images with `poseidon data images --list LIST --root ROOT "
            f"--out {tmp_path / 'ilsvrc12_train_lmdb'}` (Caffe's convert_imageset)"
            in str(e.value))


def test_a_missing_relative_source_names_every_place_looked(tmp_path: Path, monkeypatch) -> None:
    """A relative source is looked for beside the prototxt, then in the working directory:
    the error names both, absolute."""
    from engine.net import Net
    nets = tmp_path / "nets"
    nets.mkdir()
    (nets / "n.prototxt").write_text(
        'layer { name: "d" type: "Data" top: "x" top: "y" '
        'data_param { source: "data/own_lmdb" batch_size: 2 backend: LMDB } }')
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(Exception) as e:
        Net(str(nets / "n.prototxt"), phase="TRAIN")
    said = str(e.value)
    assert f"LMDB not found: {nets / 'data' / 'own_lmdb'}" in said
    assert f"(nor {elsewhere / 'data' / 'own_lmdb'})" in said
    assert "from source 'data/own_lmdb'" in said


def test_empty_and_corrupt_lmdb(tmp_path: Path) -> None:
    write_lmdb(tmp_path / "empty", [])
    with pytest.raises(LayerError, match=r"LMDB is empty: .*empty"):
        data_layer(tmp_path / "empty", 4)
    good = array_to_datum(np.zeros((1, 2, 2), np.uint8)).SerializeToString()
    write_lmdb(tmp_path / "bad", [(b"0", good), (b"1", b"\xff\xff garbage")])
    layer, tops = data_layer(tmp_path / "bad", 2, extra="strict: true")
    with pytest.raises(LayerError, match=r"corrupt record 1 \(key b'1', stream position 1\) "
                                         r"in .*bad: not a serialized Datum"):
        layer.forward([], tops)
    layer.close()
    # the only readable record stands in; a database of none stops the run all the same
    layer, tops = data_layer(tmp_path / "bad", 2)
    layer.forward([], tops)
    np.testing.assert_array_equal(tops[0].data, np.zeros((2, 1, 2, 2)))
    assert layer.stats.skipped == 1
    layer.close()
    write_lmdb(tmp_path / "worse", [(b"0", b"\xff\xff"), (b"1", b"\xff\xff garbage")])
    with pytest.raises(LayerError, match=r"corrupt record 0 .*no other record of .*worse can be "
                                         r"read either"):
        data_layer(tmp_path / "worse", 2)


def test_wrong_shape_mean_file_and_leveldb(small_db, tmp_path: Path) -> None:
    path, _, _ = small_db
    write_mean_file(tmp_path / "mean.binaryproto", np.zeros((3, 4, 5), np.float32))
    with pytest.raises(LayerError, match=r"layer 'd' \(Data\): .*mean file .*mean.binaryproto has "
                                         r"shape \(3, 4, 5\) but the data is \(1, 4, 5\)"):
        data_layer(path, 2, transform='mean_file: "mean.binaryproto"', base=tmp_path)
    try:
        import plyvel  # noqa: F401
    except ImportError:
        with pytest.raises(LayerError, match="LEVELDB needs the plyvel package"):
            make_layer(f'name: "d" type: "Data" top: "data" '
                       f'data_param {{ source: "{path}" batch_size: 1 }}', ntop=1)


def test_relative_source_resolves_against_the_naming_folder(small_db) -> None:
    path, _, labels = small_db
    layer, tops = data_layer(Path(path.name), 5, base=path.parent)
    run(layer, tops, 1)
    np.testing.assert_array_equal(tops[1].data, labels[:5])
    layer.close()


# -- ImageData, HDF5Data, MemoryData -----------------------------------------------------------

def test_image_data_layer(tmp_path: Path) -> None:
    rng = np.random.default_rng(9)
    images = rng.integers(0, 256, (5, 3, 6, 8), dtype=np.uint8)
    (tmp_path / "img").mkdir()
    lines = []
    for i, im in enumerate(images):
        (tmp_path / "img" / f"p{i}.png").write_bytes(encode_image(im))
        lines.append(f"p{i}.png {i * 10}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    text = """name: "img" type: "ImageData" top: "data" top: "label"
        transform_param {{ scale: 0.5 }}
        image_data_param {{ source: "list.txt" root_folder: "img/" {extra} }}"""
    layer, tops = make_layer(text.format(extra="batch_size: 2"), "TEST", base=tmp_path)
    got = run(layer, tops, 3)
    np.testing.assert_array_equal(got[0][0], images[:2].astype(np.float32) * 0.5)
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), [0, 10, 20, 30, 40, 0])
    # grey + resize (OpenCV's bilinear rule: an exact 2x downscale averages 2x2 blocks)
    grey, gtops = make_layer(text.format(extra="batch_size: 2 is_color: false new_height: 3 new_width: 4"),
                             "TEST", base=tmp_path)
    assert gtops[0].shape == (2, 1, 3, 4)
    run(grey, gtops, 1)
    from PIL import Image
    g = np.asarray(Image.open(tmp_path / "img" / "p0.png").convert("L"), dtype=np.float64)
    blocks = g.reshape(3, 2, 4, 2).mean(axis=(1, 3))
    np.testing.assert_array_equal(gtops[0].data[0, 0], np.floor(blocks + 0.5) * 0.5)
    # shuffle: each pass is a permutation of the list, passes differ, reproducible by seed
    backend.seed(1)
    sh, stops = make_layer(text.format(extra="shuffle: true batch_size: 5"), "TRAIN", base=tmp_path)
    passes = [tuple(b[1]) for b in run(sh, stops, 4)]
    assert all(sorted(p) == [0, 10, 20, 30, 40] for p in passes) and len(set(passes)) > 1
    backend.seed(1)
    sh2, stops2 = make_layer(text.format(extra="shuffle: true batch_size: 5"), "TRAIN", base=tmp_path)
    assert [tuple(b[1]) for b in run(sh2, stops2, 4)] == passes
    (tmp_path / "list.txt").write_text("p0.png 1\nmissing.png 2\n")
    # a missing image: the next line's takes its row; with strict, the run stops naming it
    bad, btops = make_layer(text.format(extra="batch_size: 2"), "TEST", base=tmp_path)
    bad.forward([], btops)
    np.testing.assert_array_equal(btops[0].data[1], images[0].astype(np.float32) * 0.5)
    np.testing.assert_array_equal(btops[1].data, [1, 1])
    strict = text.format(extra="batch_size: 2") + " data_param { strict: true }"
    bad2, btops2 = make_layer(strict, "TEST", base=tmp_path)
    with pytest.raises(LayerError, match=r"layer 'img' \(ImageData\): image missing.png "
                                         r"\(.*list.txt:2, stream position 1\): cannot read "
                                         r"image .*missing.png.*\(data_param.strict\)"):
        bad2.forward([], btops2)
    for l in (layer, grey, sh, sh2, bad, bad2):
        l.close()


def test_hdf5_data_layer(tmp_path: Path) -> None:
    x = np.arange(7 * 2 * 3, dtype=np.float32).reshape(7, 2, 3)
    y = np.arange(7, dtype=np.float32)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["data"], f["label"] = x[:4], y[:4]
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["data"], f["label"] = x[4:], y[4:]
    (tmp_path / "list.txt").write_text("a.h5\nb.h5\n")
    text = """name: "h" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param {{ source: "list.txt" {extra} }}"""
    layer, tops = make_layer(text.format(extra="batch_size: 3"), base=tmp_path)
    got = run(layer, tops, 3)
    assert tops[0].shape == (3, 2, 3)
    order = [0, 1, 2, 3, 4, 5, 6, 0, 1]
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), x[order])
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), y[order])
    backend.seed(0)
    sh, stops = make_layer(text.format(extra="shuffle: true batch_size: 7"), base=tmp_path)
    passes = [b[1] for b in run(sh, stops, 3)]
    assert all(sorted(p) == list(range(7)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1
    with pytest.raises(LayerError, match="has no dataset 'other'"):
        make_layer(text.format(extra="batch_size: 3").replace('top: "label"', 'top: "other"'),
                   base=tmp_path)


def test_memory_data_layer() -> None:
    layer, tops = make_layer("""name: "m" type: "MemoryData" top: "data" top: "label"
        memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 }""")
    with pytest.raises(LayerError, match="call reset"):
        layer.forward([], tops)
    data = np.arange(4 * 4, dtype=np.float32).reshape(4, 1, 2, 2)
    layer.reset(data, np.arange(4).reshape(4, 1, 1, 1))
    got = run(layer, tops, 3)
    np.testing.assert_array_equal(got[2][0], data[:2])
    np.testing.assert_array_equal(got[1][1], [2, 3])
    with pytest.raises(LayerError, match="multiple of batch_size"):
        layer.reset(data[:3], np.arange(3))
    with pytest.raises(LayerError, match="does not match"):
        layer.reset(np.zeros((2, 3, 2, 2)), np.arange(2))


# -- command line ------------------------------------------------------------------------------------

def test_cli_digits_then_data_layer(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "poseidon_cli.main", "data"]
    r = subprocess.run(cmd + ["digits", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "digits_train_lmdb: 1500 records" in r.stdout
    assert "digits_test_lmdb: 297 records" in r.stdout
    layer, tops = data_layer(tmp_path / "digits_test_lmdb", 297, "TEST")
    run(layer, tops, 1)
    images, labels = converters.digits_arrays()
    np.testing.assert_array_equal(tops[0].data, images[1500:])
    np.testing.assert_array_equal(tops[1].data, labels[1500:])
    layer.close()
    r = subprocess.run(cmd + ["mean", "--db", str(tmp_path / "nope_lmdb"), "--out",
                              str(tmp_path / "m.binaryproto")], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "LMDB not found" in r.stderr and "nope_lmdb" in r.stderr


def test_cli_reports_missing_idx_files(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "poseidon_cli.main", "data", "mnist", "--out",
                        str(tmp_path / "out"), "--from", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "no train-images-idx3-ubyte[.gz]" in r.stderr


def test_caffe_lenet_net_reads_its_lmdb(mnist_dir: Path) -> None:
    from engine.net import Net
    net = Net(str(shared_path("fixtures", "oracle", "train", "lenet_train_test.prototxt")),
              phase="TRAIN")
    (layer,) = net.data_layers
    net.forward_prefilled()
    _, labels = converters.load_idx_pair(mnist_dir, "train", limit=64)
    np.testing.assert_array_equal(net.blobs["label"].data, labels[:64])
    assert layer.position() == 64
    layer.seek(6400)  # the oracle's lenet_iter_100 position
    net.forward_prefilled()
    layer.close()
    db = open_db(shared_path("fixtures", "oracle", "train", "mnist_train_lmdb"))
    first = parse_datum(db.get(6400)[1])
    db.close()
    assert net.blobs["label"].data[0] == first.label and layer.position() == 6464
