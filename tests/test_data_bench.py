"""`poseidon bench data`: Poseidon's data path per decoder count beside a `caffe time` on the
same data-only net; a Caffe that cannot read the records is reported with the line it said."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from engine.data.lmdb_source import write_lmdb
from engine.pb import caffe_pb2
from tests.test_data_decoders import jpeg, smooth_pictures


def test_bench_data_times_each_decoder_count_beside_caffe(tmp_path):
    from poseidon_cli.main import cli
    pics = smooth_pictures(6)
    raw = [(b"%d" % i, caffe_pb2.Datum(channels=3, height=16, width=18, label=i,
                                       data=p[:, :, ::-1].transpose(2, 0, 1).tobytes()))
           for i, p in enumerate(pics)]
    enc = [(b"%d" % i, caffe_pb2.Datum(label=i, encoded=True, data=jpeg(p)))
           for i, p in enumerate(pics)]
    for name, records in (("raw", raw), ("enc", enc)):
        write_lmdb(tmp_path / name, [(k, d.SerializeToString()) for k, d in records])
    net = tmp_path / "train_val.prototxt"
    net.write_text('''layer { name: "d" type: "Data" top: "data" top: "label"
        include { phase: TRAIN }
        transform_param { crop_size: 12 mirror: true mean_value: 100 }
        data_param { source: "elsewhere" batch_size: 4 backend: LMDB } }''')
    # a stand-in for `caffe time`: it must be handed the data-only net on the same LMDB and
    # without Poseidon's fields; it reads raw records and, built without OpenCV, not encoded
    fake = tmp_path / "caffe"
    fake.write_text("#!/bin/sh\n"
                    'grep -q decoders "$3" && exit 3\n'
                    'grep -q \'type: "Silence"\' "$3" || exit 3\n'
                    f'if grep -q "{tmp_path / "enc"}" "$3"; then\n'
                    '  echo "F20261126 00:45:27.141021 1 data_transformer.cpp:457] Encoded datum '
                    'requires OpenCV; compile with USE_OPENCV." >&2; echo "    @ 0x1 _start" >&2\n'
                    '  exit 134\nfi\n'
                    'echo "I1125 caffe.cpp:412] Average Forward-Backward: 40 ms." >&2\n')
    fake.chmod(0o755)
    out = tmp_path / "data.json"
    r = CliRunner().invoke(cli, ["bench", "data", "--db", str(tmp_path / "raw"), "--db",
                                 str(tmp_path / "enc"), "--net", str(net), "--decoders", "1,2",
                                 "--iterations", "2", "--repeats", "1", "--caffe", str(fake),
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["batch"] == 4 and "crop_size: 12" in report["transform_param"]
    raw_r, enc_r = report["databases"]["raw"], report["databases"]["enc"]
    assert raw_r["caffe"]["median_ms"] == 40.0
    for d in ("poseidon-1", "poseidon-2"):
        e = raw_r[d]
        assert e["median_ms"] > 0 and e["images_per_s"] == pytest.approx(4000 / e["median_ms"])
        assert e["ratio_vs_caffe"] == pytest.approx(e["median_ms"] / 40.0)
        assert set(e["per_batch_ms"]) == {"read", "decode", "transform", "wait"}
    assert raw_r["poseidon-1"]["speedup_vs_first"] == 1.0
    assert enc_r["caffe"] == {"failed": "caffe time on enc_caffe.prototxt failed: Encoded "
                                        "datum requires OpenCV; compile with USE_OPENCV."}
    assert enc_r["poseidon-2"]["per_batch_ms"]["decode"] > 0
    assert "enc    caffe       failed: caffe time on enc_caffe.prototxt failed: Encoded datum" \
        in r.output


def test_bench_data_refuses_bad_options(tmp_path):
    from poseidon_cli.main import cli
    for args, said in ((["--decoders", "0,2"], "--decoders: positive counts"),
                       (["--caffe", str(tmp_path / "nothing")], "no such executable")):
        r = CliRunner().invoke(cli, ["bench", "data", *args])
        assert r.exit_code != 0 and said in r.output
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "x" type: "Input" top: "x" }')
    r = CliRunner().invoke(cli, ["bench", "data", "--net", str(net)])
    assert r.exit_code != 0 and "no Data layer in the TRAIN phase" in r.output
