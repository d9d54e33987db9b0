"""Caffe protobuf schema bindings.

``caffe_pb2`` is generated from ``proto/caffe.proto`` by ``tools/gen_proto.py``;
do not edit it by hand.
"""
