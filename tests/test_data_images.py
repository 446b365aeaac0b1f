"""`poseidon data images` (convert_imageset) and `poseidon data mean` on a folder of real PNG
files: the LMDB that the Data layer reads back pixel for pixel, encoded records, bad images,
and the mean against NumPy's."""
from __future__ import annotations

import time
from pathlib import Path

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from engine.data.transformer import read_mean_file
from engine.net import Net
from engine.pb import caffe_pb2
from poseidon_cli.commands.data import data

N = 24


def poseidon_data(*args: object) -> tuple[int, str]:
    r = CliRunner().invoke(data, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    """N of scikit-learn's digits as grey 8x8 PNGs in a sub-folder, and their list file."""
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("digits")
    d = load_digits()
    images = np.rint(d.images[:N] * (255 / 16)).astype(np.uint8)
    labels = d.target[:N]
    (root / "png").mkdir()
    lines = []
    for i, (im, label) in enumerate(zip(images, labels)):
        Image.fromarray(im, mode="L").save(root / "png" / f"digit {i}.png")  # a space in the name
        lines.append(f"digit {i}.png {label}")
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    return root, images, labels


def read_back(db: Path, batch: int, phase: str = "TEST") -> tuple[np.ndarray, np.ndarray]:
    """Every record of ``db`` through a Data layer of a net, in database order."""
    text = f"""layer {{ name: "d" type: "Data" top: "data" top: "label"
                 data_param {{ source: "{db}" batch_size: {batch} backend: LMDB }} }}"""
    path = db.parent / f"{db.name}.prototxt"
    path.write_text(text)
    net = Net(path, phase)
    net.forward()
    out = net.blobs["data"].data.copy(), net.blobs["label"].data.copy()
    for layer in net.data_layers:
        layer.close()
    return out


def records(db: Path) -> list[tuple[bytes, caffe_pb2.Datum]]:
    env = lmdb.open(str(db), readonly=True, lock=False)
    with env.begin() as txn:
        out = [(k, caffe_pb2.Datum.FromString(v)) for k, v in txn.cursor()]
    env.close()
    return out


def test_digit_pngs_become_an_lmdb_the_data_layer_reads_back_exactly(digits_folder, tmp_path):
    root, images, labels = digits_folder
    code, out = poseidon_data("images", "--list", root / "list.txt", "--root", root / "png",
                              "--out", tmp_path / "db", "--gray")
    assert code == 0, out
    assert f"{N} records" in out
    got, got_labels = read_back(tmp_path / "db", N)
    np.testing.assert_array_equal(got, images[:, None].astype(np.float32))
    np.testing.assert_array_equal(got_labels, labels)
    keys = [k for k, _ in records(tmp_path / "db")]
    assert keys[:2] == [b"00000000_digit 0.png", b"00000001_digit 1.png"]  # Caffe's keys

    # compute_image_mean = NumPy's mean of the same pictures
    code, out = poseidon_data("mean", tmp_path / "db", "--out", tmp_path / "mean.binaryproto")
    assert code == 0, out
    np.testing.assert_allclose(read_mean_file(tmp_path / "mean.binaryproto")[0],
                               images.astype(np.float64).mean(axis=0), rtol=1e-6)


def test_colour_encoded_and_resized_records(tmp_path):
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 256, (4, 5, 7, 3), dtype=np.uint8)
    (tmp_path / "img").mkdir()
    for i, im in enumerate(rgb):
        # uncompressed: unlike what re-encoding them would give
        Image.fromarray(im, mode="RGB").save(tmp_path / "img" / f"c{i}.png", compress_level=0)
    (tmp_path / "list.txt").write_text("".join(f"c{i}.png {i}\n" for i in range(4)))
    bgr_chw = rgb[..., ::-1].transpose(0, 3, 1, 2)  # what Caffe's OpenCV reading gives

    args = ["images", "--list", tmp_path / "list.txt", "--root", tmp_path / "img"]
    assert poseidon_data(*args, "--out", tmp_path / "raw")[0] == 0
    np.testing.assert_array_equal(read_back(tmp_path / "raw", 4)[0], bgr_chw)

    # encoded, no resize, same extension: the files' own bytes (Caffe's ReadFileToDatum)
    assert poseidon_data(*args, "--out", tmp_path / "enc", "--encoded")[0] == 0
    recs = records(tmp_path / "enc")
    assert all(d.encoded and not d.channels for _, d in recs)
    assert recs[2][1].data == (tmp_path / "img" / "c2.png").read_bytes()
    np.testing.assert_array_equal(read_back(tmp_path / "enc", 4)[0], bgr_chw)

    # another encoding re-encodes; PNG is lossless, so the pixels survive
    assert poseidon_data(*args, "--out", tmp_path / "bmp", "--encode-type", "bmp")[0] == 0
    assert records(tmp_path / "bmp")[0][1].data[:2] == b"BM"
    np.testing.assert_array_equal(read_back(tmp_path / "bmp", 4)[0], bgr_chw)

    # resize: an exact 2x upscale of a constant picture stays that constant
    Image.new("RGB", (7, 5), (10, 20, 30)).save(tmp_path / "img" / "flat.png")
    (tmp_path / "flat.txt").write_text("flat.png 0\n")
    assert poseidon_data("images", "--list", tmp_path / "flat.txt", "--root", tmp_path / "img",
                         "--out", tmp_path / "big", "--resize-height", 10,
                         "--resize-width", 14)[0] == 0
    big = read_back(tmp_path / "big", 1)[0]
    assert big.shape == (1, 3, 10, 14)
    np.testing.assert_array_equal(big[0, :, 0, 0], [30, 20, 10])
    assert np.ptp(big.reshape(3, -1), axis=1).max() == 0


def test_shuffle_is_a_seeded_permutation(digits_folder, tmp_path):
    root, images, labels = digits_folder
    args = ["images", "--list", root / "list.txt", "--root", root / "png", "--gray", "--shuffle"]
    assert poseidon_data(*args, "--out", tmp_path / "a")[0] == 0
    assert poseidon_data(*args, "--out", tmp_path / "b")[0] == 0
    keys = [k for k, _ in records(tmp_path / "a")]
    assert keys == [k for k, _ in records(tmp_path / "b")]  # same seed, same order
    order = [int(k.split(b"_")[1].split(b" ")[1].split(b".")[0]) for k in keys]
    assert sorted(order) == list(range(N)) and order != list(range(N))
    got, got_labels = read_back(tmp_path / "a", N)
    np.testing.assert_array_equal(got[:, 0], images[order])
    np.testing.assert_array_equal(got_labels, labels[order])


def test_bad_images_are_named_and_skipped_or_stop_a_strict_run(digits_folder, tmp_path):
    root, images, _ = digits_folder
    (tmp_path / "not.png").write_bytes(b"\x89PNG but not really")
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "small.png")
    good = (root / "list.txt").read_text().splitlines()[:3]
    lines = [*good, "missing.png 1", str(tmp_path / "not.png") + " 2", str(tmp_path / "small.png") + " 3"]
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    args = ["images", "--list", tmp_path / "list.txt", "--root", root / "png", "--gray"]

    code, out = poseidon_data(*args, "--out", tmp_path / "db", "--check-size")
    assert code == 0, out
    assert "3 records, 3 bad images skipped" in out
    assert "skipping missing.png (" in out and "list.txt:4): cannot read image" in out
    assert "not.png" in out and "cannot decode image" in out
    assert "small.png" in out and "(1, 4, 4) differs from the first image's (1, 8, 8)" in out
    np.testing.assert_array_equal(read_back(tmp_path / "db", 3)[0][:, 0], images[:3])

    # strict: one line naming list line and file, a non-zero exit, the old database intact
    before = (tmp_path / "db" / "data.mdb").read_bytes()
    code, out = poseidon_data(*args, "--out", tmp_path / "db", "--strict", "--force")
    assert code == 1
    assert out.strip().splitlines()[-1].startswith("poseidon: error: ")
    assert "list.txt:4: cannot read image" in out and "missing.png" in out
    assert (tmp_path / "db" / "data.mdb").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".db")) == []

    code, out = poseidon_data(*args, "--out", tmp_path / "db")
    assert code == 1 and "already exists" in out
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "keep.txt").write_text("mine")
    code, out = poseidon_data(*args, "--out", tmp_path / "junk", "--force")
    assert code == 1 and "not an LMDB folder" in out
    assert (tmp_path / "junk" / "keep.txt").read_text() == "mine"


def test_a_malformed_list_is_named_by_line(tmp_path):
    (tmp_path / "list.txt").write_text("a.png 1\nb.png one\n")
    code, out = poseidon_data("images", "--list", tmp_path / "list.txt", "--out", tmp_path / "db")
    assert code == 1
    assert "list.txt:2: expected '<image path> <integer label>', got 'b.png one'" in out
    assert not (tmp_path / "db").exists()


def test_caffes_positional_forms_and_flags(digits_folder, tmp_path):
    """`convert_imageset -gray ROOT/ LIST DB` and `compute_image_mean DB OUT`, as Caffe users
    type them, write what the option forms write."""
    from poseidon_cli.main import cli

    def poseidon(*args: object) -> tuple[int, str]:
        r = CliRunner().invoke(cli, [str(a) for a in args])
        return r.exit_code, r.output

    root, images, _ = digits_folder
    code, out = poseidon("data", "images", "-gray", "-backend", "lmdb", f"{root / 'png'}/",
                         root / "list.txt", tmp_path / "caffe_db")
    assert code == 0, out
    poseidon_data("images", "--list", root / "list.txt", "--root", root / "png", "--out",
                  tmp_path / "db", "--gray")
    assert records(tmp_path / "caffe_db") == records(tmp_path / "db")
    code, out = poseidon("data", "mean", tmp_path / "caffe_db", tmp_path / "mean.binaryproto")
    assert code == 0, out
    np.testing.assert_allclose(read_mean_file(tmp_path / "mean.binaryproto")[0],
                               images.astype(np.float64).mean(axis=0), rtol=1e-6)


@pytest.mark.parametrize("args, needle", [
    (["images", "ROOT", "LIST"], "2 paths given: in Caffe's order they are ROOT LIST DB"),
    (["images", "R", "L", "D", "--out", "x"], "in Caffe's order (ROOT LIST DB) or as --root, "
                                              "--list, --out, not both"),
    (["images", "--out", "x"], "which images, and where to?"),
    (["images", "--list", "missing.txt", "--out", "x"], "list file missing.txt not found"),
    (["images", "--list", "{list}", "--out", "x", "--backend", "leveldb"],
     "--backend leveldb: Poseidon writes LMDB only"),
    (["mean", "DB"], "which database, and where to?"),
    (["mean", "DB", "OUT", "--out", "o"], "in Caffe's order (DB OUT) or as --db, --out, not both"),
])
def test_data_paths_given_wrong_are_one_line(digits_folder, tmp_path, args, needle):
    root = digits_folder[0]
    code, out = poseidon_data(*[a.format(list=root / "list.txt") for a in args])
    assert code != 0
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("poseidon: error: ") and needle in lines[0], out
    assert not (tmp_path / "x").exists() and not Path("x").exists()


def make_pngs(folder: Path, n: int) -> Path:
    """``n`` distinct 6x7 colour PNGs and their list file."""
    folder.mkdir()
    rng = np.random.default_rng(11)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (6, 7, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (folder / "list.txt").write_text("".join(f"{i}.png {i % 10}\n" for i in range(n)))
    return folder / "list.txt"


def test_an_interrupted_conversion_resumes_to_the_same_lmdb(tmp_path):
    """A real process, stopped by SIGINT part way, then run again: the same records as a
    conversion that ran through. The 601st image is a FIFO that gives nothing until the
    process has ended, so the run stalls there (in its third chunk) and the interruption
    lands after a whole number of chunks."""
    import errno
    import os
    import re
    import signal
    import subprocess
    import sys

    from engine.data.imageset import CHUNK, partial_path
    from tests.conftest import ROOT

    n = 800
    list_file = make_pngs(tmp_path / "img", n)
    args = ["images", "--list", str(list_file), "--root", str(tmp_path / "img"),
            "--resize-height", "9", "--resize-width", "8", "--shuffle", "--decoders", "2"]
    assert poseidon_data(*args, "--out", tmp_path / "clean")[0] == 0

    order = np.random.default_rng(0).permutation(n)  # --shuffle's order (seed 0)
    png = tmp_path / "img" / f"{order[600]}.png"
    saved = png.read_bytes()
    png.unlink()
    os.mkfifo(png)
    out = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "poseidon_cli.main", "data", *args, "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    writer = None
    try:
        deadline = time.monotonic() + 120  # liveness bounds, generous for a busy machine
        while writer is None and time.monotonic() < deadline and proc.poll() is None:
            try:  # succeeds once a decoder is opening the FIFO: the run has reached it
                writer = os.open(png, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO
                time.sleep(0.02)
        assert writer is not None, "the conversion never reached the stalled image"
        time.sleep(1.0)  # the writer finishes the chunks before, then waits
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if writer is not None:
            os.close(writer)
    assert proc.returncode == 130, err
    done = int(re.search(rf"interrupted after (\d+) of {n} images", err).group(1))
    assert done in (CHUNK, 2 * CHUNK) and "run the same command again to continue" in err
    assert not out.exists() and partial_path(out).is_dir()

    png.unlink()
    png.write_bytes(saved)
    code, text = poseidon_data(*args, "--out", out)
    assert code == 0, text
    assert f"resuming {out}: {done} of {n} images were done before" in text
    assert f"wrote {out}: {n} records, 0 bad images skipped" in text
    assert records(out) == records(tmp_path / "clean")
    assert not partial_path(out).exists()


def test_a_resume_with_other_options_says_why_it_cannot(tmp_path):
    from engine.data.imageset import PROGRESS, partial_path

    list_file = make_pngs(tmp_path / "img", 5)
    out = tmp_path / "db"
    partial = partial_path(out)
    args = ["images", "--list", list_file, "--root", tmp_path / "img", "--out", out]
    # an unfinished conversion of the same list, made without --gray
    assert poseidon_data(*args)[0] == 0
    progress = {"signature": {}, "next": 2, "written": 2, "skipped": 0, "first_shape": None}
    from engine.data.imageset import ImagesetOptions, _signature
    progress["signature"] = _signature(list_file, tmp_path / "img", ImagesetOptions())
    out.rename(partial)
    (partial / PROGRESS).write_text(__import__("json").dumps(progress))
    code, text = poseidon_data(*args, "--gray")
    assert code == 1
    assert (f"cannot resume the unfinished conversion in {partial}: it was started with "
            f"another --gray; pass --force to start over") in text
    code, text = poseidon_data(*args, "--gray", "--force")
    assert code == 0 and "wrote" in text and "5 records" in text
    got = read_back(out, 5)[0]
    assert got.shape == (5, 1, 6, 7)
