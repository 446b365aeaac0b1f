"""Every module's log records become glog lines (parse_log.py reads them), on one stream."""
from __future__ import annotations

import io
import logging
import re

import pytest

from engine import glog
from engine.net import Net
from tests.test_cli_errors import GOOD

PREFIX = r"[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d{6} +\d+ [\w.]+:\d+\] "


@pytest.fixture
def log_stream():
    stream = io.StringIO()
    glog.set_stream(stream)
    try:
        yield stream
    finally:
        glog.set_stream(None)
        glog.set_enabled(True)


def test_ignoring_source_layer_is_shown_as_caffe_shows_it(tmp_path, log_stream):
    extra = GOOD.replace('layer { name: "loss"', 'layer { name: "extra" type: "InnerProduct" '
                         'bottom: "x" top: "e" inner_product_param { num_output: 2 } }\n'
                         'layer { name: "loss"')
    (tmp_path / "a.prototxt").write_text(extra)
    (tmp_path / "b.prototxt").write_text(GOOD)
    Net(str(tmp_path / "a.prototxt"), phase="TRAIN").save(str(tmp_path / "a.caffemodel"))
    Net(str(tmp_path / "b.prototxt"), phase="TRAIN", weights=str(tmp_path / "a.caffemodel"))
    lines = log_stream.getvalue().splitlines()
    assert any(re.fullmatch(PREFIX.replace("[IWEF]", "I") + "Ignoring source layer extra", l)
               for l in lines), lines


def test_quiet_ranks_still_show_warnings(log_stream):
    glog.set_enabled(False)
    glog.info("not shown")
    logging.getLogger("poseidon.comm").warning("dropped a duplicate push of param %d", 3)
    [line] = log_stream.getvalue().splitlines()
    assert re.fullmatch(PREFIX.replace("[IWEF]", "W") + "dropped a duplicate push of param 3", line)
    assert "test_glog.py:" in line  # the caller's file and line, as glog prints them
