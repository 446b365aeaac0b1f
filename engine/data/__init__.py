"""Input data: Caffe's LMDB/LevelDB of Datum, image lists, HDF5, data layers, converters.

Modules: datum (Datum <-> NumPy, image decoding), lmdb_source (databases by record index),
transformer (Caffe's DataTransformer), prefetch (background batch thread), decoders (the
threads that decode and transform a batch's images), layers (the data
layers, registered on import), converters (MNIST, CIFAR-10, Fashion-MNIST, digits -> LMDB;
the image mean).
"""
