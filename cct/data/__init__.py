"""Data: Datum records and LMDB databases, Caffe's DataTransformer, the data layers and the dataset
tools (convert_imageset, compute_image_mean).

Importing this package registers the data layers: Data, ImageData, MemoryData, DummyData, HDF5Data,
HDF5Output and WindowData.
"""
from cct.data import (  # noqa: F401  (imported for registration)
    data_layer,
    hdf5_layers,
    image_data_layer,
    memory_data,
    window_data,
)
