"""``cct infer``: dense sliding-window inference of a volume larger than memory (ZNNi; :mod:`cct.inference`).

    cct infer -model deploy.prototxt -weights w.caffemodel -input VOLUME -output OUT.h5
              [-memory_budget 2GiB] [-plan auto|measure] [-engine auto|lowering|fft] [-pad valid|mirror]
              [-input_scale S] [-input_mean M[,M...]] [-quiet] [-devices cpu:T,cpu:T,...]

VOLUME: ``path.h5`` (one dataset) or ``path.h5:dataset``, ``.npy``, a multi-page TIFF, or a PNG/JPEG for 2-D
nets; ``(C, Z, Y, X)`` or ``(Z, Y, X)``.  OUT.h5 gets dataset ``output`` ``(C_out, Z-F_z+1, Y-F_y+1, X-F_x+1)``
(``-pad mirror``: the input's size).  The planner's choice is logged before the run; a progress bar goes to
stderr (``-quiet``: none).  ``-devices cpu:1,cpu:1``: CPU workers sharing the tiles (each its own net and
threads, the budget split between them).
"""
from __future__ import annotations

from cct.errors import CctError
from cct.flags import Flag, Flags

SUMMARY = "dense sliding-window inference of a large volume (HDF5 output)"
FLAGS = [
    Flag("input", str, "", "The input volume: path.h5[:dataset], .npy, a multi-page .tif, or an image (2-D nets)."),
    Flag("output", str, "", "The output HDF5 file (dataset 'output', shape (C_out, *valid region))."),
    Flag("memory_budget", str, "2GiB", "Optional; memory for the run, e.g. 2GiB, 512MiB, 1.5G."),
    Flag("plan", str, "auto", "Optional; auto (the planner's prediction) or measure (time the best candidates)."),
    Flag("engine", str, "auto", "Optional; convolution primitives the planner may use: auto, lowering or fft."),
    Flag("pad", str, "valid", "Optional; valid (output = input - FOV + 1) or mirror (output the input's size)."),
    Flag("input_scale", float, 1.0, "Optional; multiply the input by this after subtracting the mean."),
    Flag("input_mean", str, "", "Optional; subtract this from the input: one value, or one per channel (a,b,c)."),
    Flag("quiet", bool, False, "Optional; no progress bar."),
]


def main(flags: Flags) -> int:
    from cct.inference import infer

    if not flags.model:
        raise CctError("Need a model definition to infer with (-model deploy.prototxt).")
    if not flags.input:
        raise CctError("Need an input volume (-input VOLUME).")
    if not flags.output:
        raise CctError("Need an output file (-output OUT.h5).")
    if flags.gpu:
        raise CctError(f"-gpu {flags.gpu}: cct infer runs on the CPU")
    mean = None
    if flags.input_mean:
        try:
            mean = [float(v) for v in flags.input_mean.split(",")]
        except ValueError:
            raise CctError(f"-input_mean {flags.input_mean}: expected numbers separated by ','") from None
    infer(flags.model, flags.weights or None, flags.input, flags.output, memory_budget=flags.memory_budget,
          plan=flags.plan, engine=flags.engine, pad=flags.pad, input_scale=flags.input_scale, input_mean=mean,
          quiet=flags.quiet, devices=flags.devices or None)
    return 0
