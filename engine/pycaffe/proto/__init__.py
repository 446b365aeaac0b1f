"""``caffe.proto``: pycaffe's home of the generated protobuf module, ``caffe.proto.caffe_pb2``."""
from . import caffe_pb2  # noqa: E402,F401  (BVLC's: reachable after `import caffe`)
