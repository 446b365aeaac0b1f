"""``caffe.proto.caffe_pb2`` is the engine's generated module itself (engine/pb/caffe_pb2), not
a copy: its message classes are the ones the engine builds and accepts."""
import sys

from engine.pb import caffe_pb2 as _engine_caffe_pb2

sys.modules[__name__] = _engine_caffe_pb2
