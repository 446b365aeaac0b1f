"""``caffe.proto``: pycaffe's home of the generated protobuf module, ``caffe.proto.caffe_pb2``."""
