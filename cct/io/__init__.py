"""File formats (prototxt, caffemodel, binaryproto, solverstate, HDF5) and pycaffe's ``caffe.io`` helpers."""
