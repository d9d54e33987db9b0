"""Regenerate cct/proto/caffe_pb2.py from proto/caffe.proto.

Usage (from any working directory)::

    python tools/gen_proto.py

Requires grpcio-tools (it bundles protoc). Paths are resolved relative to this
script, so the repository layout is all that matters.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
OUT_DIR = os.path.join(ROOT, "cct", "proto")
PROTO_FILE = os.path.join(PROTO_DIR, "caffe.proto")


def generate(out_dir=OUT_DIR):
    """Run protoc on caffe.proto, writing caffe_pb2.py into ``out_dir``."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        "-I" + PROTO_DIR,
        "--python_out=" + out_dir,
        PROTO_FILE,
    ]
    status = protoc.main(args)
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}")
    return os.path.join(out_dir, "caffe_pb2.py")


def main():
    path = generate()
    print("wrote " + path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
