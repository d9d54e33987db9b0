"""File formats and pycaffe's ``caffe.io``.

``cct.io`` is pycaffe's ``caffe.io`` (Transformer, load_image, blobproto/datum helpers); the file-format
modules live beside it: :mod:`cct.io.prototxt` (text nets and solvers, upgrades in :mod:`cct.io.upgrade`),
:mod:`cct.io.weights` (caffemodel, binaryproto, solverstate; atomic writes), :mod:`cct.io.hdf5`.
"""
from cct.io.convert import (
    array_to_blobproto,
    array_to_datum,
    arraylist_to_blobprotovecor_str,
    arraylist_to_blobprotovector_str,
    blobproto_to_array,
    blobprotovector_str_to_arraylist,
    datum_to_array,
)
from cct.io.transformer import Transformer, load_image, oversample, resize_image
from cct.proto import caffe_pb2

__all__ = [
    "Transformer", "array_to_blobproto", "array_to_datum", "arraylist_to_blobprotovecor_str",
    "arraylist_to_blobprotovector_str", "blobproto_to_array", "blobprotovector_str_to_arraylist", "caffe_pb2",
    "datum_to_array", "load_image", "oversample", "resize_image",
]
