"""cct: a drop-in for Caffe 1.0.  ``import cct as caffe`` gives pycaffe's API.

The same prototxt, caffemodel, solverstate and binaryproto files as Caffe; the same numbers layer by
layer; the same command line (``cct train -solver s.prototxt``) and log lines.
"""
# first, before anything loads numpy's OpenBLAS: importing it sets OpenBLAS's worker spin (cct.runtime.threads)
from cct.runtime import threads as _threads  # noqa: F401

# isort: split
from cct import io, layers, log
from cct.classifier import Classifier
from cct.detector import Detector
from cct.distributed.processes import NCCL
from cct.exec import set_executor
from cct.exec.device_split import set_devices
from cct.layers.base import Layer
from cct.layers.registry import layer_type_list
from cct.log import init_log
from cct.mode import (
    has_nccl,
    set_device,
    set_mode_cpu,
    set_mode_gpu,
    set_multiprocess,
    set_solver_count,
    set_solver_rank,
    solver_count,
    solver_rank,
)
from cct.net_spec import NetSpec, params, to_proto
from cct.proto import caffe_pb2
from cct.pycaffe import TEST, TRAIN, Net
from cct.rng import set_random_seed
from cct.solvers import (
    AdaDeltaSolver,
    AdaGradSolver,
    AdamSolver,
    NesterovSolver,
    RMSPropSolver,
    SGDSolver,
    get_solver,
)
from cct.timer import Timer

__version__ = "1.0.0"

__all__ = [
    "AdaDeltaSolver", "AdaGradSolver", "AdamSolver", "NesterovSolver", "RMSPropSolver", "SGDSolver", "Timer",
    "get_solver", "Classifier", "Detector", "NCCL", "NetSpec", "layers", "params", "to_proto",
    "Layer", "Net", "TEST", "TRAIN", "__version__", "caffe_pb2", "has_nccl", "init_log", "io",
    "layer_type_list", "log", "set_device", "set_mode_cpu", "set_mode_gpu", "set_multiprocess",
    "set_devices",
    "set_executor", "set_random_seed", "set_solver_count", "set_solver_rank", "solver_count", "solver_rank",
]
