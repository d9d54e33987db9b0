"""Net rewrites: a pooled net into its max-filter twin (ZNN's dense training, Zlateski et al. §II-A).

A max-pooling layer with kernel ``p`` and stride ``p`` keeps every ``p``-th window; the *max-filter* with the
same kernel and stride 1 keeps all of them.  Once a pooling layer of the net is replaced by its max-filter,
the blobs below it are dense where they were subsampled by ``p``: each later layer must look at its inputs
``p`` times further apart to see what it saw before.  With ``s`` the product of the pooling kernels replaced
so far (the sparsity; per spatial axis):

* a convolution with dilation ``d`` becomes one with dilation ``d·s`` (sparse convolution);
* a pooling layer with kernel ``p`` becomes a max-filter: stride 1, ``dilation_nd = s``, and ``s ← s·p``;
* element-wise layers (neurons, BatchNorm, Scale, Eltwise, Split, Softmax over the channels, losses, …) are
  unchanged.

The twin maps an input of ``n`` voxels to ``n - F + 1`` outputs (``F`` the field of view), and its output at
position ``z`` equals the pooled net's output on the input window starting at ``z`` — the pooled net's output
is the twin's at the positions ``z ≡ 0 (mod Π p)``.  For CTMCTMCTCT (3³ kernels, 2³ pooling) the convolution
dilations become 1, 2, 4, 4 and the filter skips 1, 2; the field of view is 26, so an input of 37³ gives a
dense 12³ output.

Refused, each with a one-line :class:`CctError` naming the layer: padded convolutions and poolings, strided
convolutions, poolings whose stride differs from their kernel or that are not MAX, and layers that do not act
position by position (InnerProduct, and any type not known to be element-wise).
"""
from __future__ import annotations

from collections.abc import Sequence

from cct.errors import CctError
from cct.proto import caffe_pb2 as pb

__all__ = ["to_max_filter", "ELEMENTWISE"]

# layers that act on every position alike and have no window: the rewrite leaves them as they are
ELEMENTWISE = frozenset((
    "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "BNLL", "Power", "Exp", "Log", "Threshold", "Clip",
    "Swish", "Dropout", "BatchNorm", "Scale", "Bias", "Eltwise", "Split", "Softmax", "SoftmaxWithLoss",
    "EuclideanLoss", "SigmoidCrossEntropyLoss", "Accuracy", "Input", "Data", "HDF5Data", "MemoryData",
    "DummyData", "Silence", "Concat", "Flatten", "Reshape",
))


def _per_axis(values: Sequence[int], nd: int, default: int, what: str, lp: pb.LayerParameter,
              source: str) -> list[int]:
    v = [int(x) for x in values] or [default]
    if len(v) == 1:
        v = v * nd
    if len(v) != nd:
        raise CctError(f"{source}: layer '{lp.name}' ({lp.type}): {what} has {len(v)} values for {nd} "
                       f"spatial axes")
    return v


def _pool_fields(lp: pb.LayerParameter, nd: int, source: str) -> tuple[list[int], list[int], list[int]]:
    p = lp.pooling_param
    where = f"{source}: layer '{lp.name}' (Pooling)"
    if p.global_pooling:
        raise CctError(f"{where}: global pooling has no max-filter twin")
    if len(p.kernel_nd):
        kernel = _per_axis(p.kernel_nd, nd, 1, "kernel_nd", lp, source)
    elif p.HasField("kernel_h"):
        kernel = [int(p.kernel_h), int(p.kernel_w)]
    else:
        kernel = [int(p.kernel_size)] * nd
    if len(p.stride_nd):
        stride = _per_axis(p.stride_nd, nd, 1, "stride_nd", lp, source)
    elif p.HasField("stride_h"):
        stride = [int(p.stride_h), int(p.stride_w)]
    else:
        stride = [int(p.stride)] * nd
    pad = (_per_axis(p.pad_nd, nd, 0, "pad_nd", lp, source) if len(p.pad_nd)
           else [int(p.pad_h), int(p.pad_w)] if p.HasField("pad_h") else [int(p.pad)] * nd)
    dilation = _per_axis(p.dilation_nd, nd, 1, "dilation_nd", lp, source)
    if p.pool != pb.PoolingParameter.MAX:
        raise CctError(f"{where}: only MAX pooling has a max-filter twin (pool is "
                       f"{pb.PoolingParameter.PoolMethod.Name(p.pool)})")
    if any(pad):
        raise CctError(f"{where}: pooling_param.pad {pad} must be 0 for a max-filter twin")
    if stride != kernel:
        raise CctError(f"{where}: pooling_param.stride {stride} must equal the kernel {kernel} for a "
                       f"max-filter twin")
    if any(d != 1 for d in dilation):
        raise CctError(f"{where}: pooling_param.dilation_nd {dilation}: the net is already sparse")
    return kernel, stride, pad


def to_max_filter(param: pb.NetParameter, num_spatial: int, source: str = "<net>") -> pb.NetParameter:
    """The max-filter twin of ``param`` (see the module docstring); ``num_spatial``: the spatial axes of its
    blobs (3 for volumes).  ``param`` is not changed."""
    if param.layers:
        raise CctError(f"{source}: V1 'layers' nets: upgrade the net first (cct upgrades it on read)")
    out = pb.NetParameter()
    out.CopyFrom(param)
    nd = int(num_spatial)
    sparsity = [1] * nd
    for lp in out.layer:
        where = f"{source}: layer '{lp.name}' ({lp.type})"
        if lp.type == "Convolution":
            c = lp.convolution_param
            if any(int(v) for v in c.pad) or c.pad_h or c.pad_w:
                raise CctError(f"{where}: convolution_param.pad must be 0 for a max-filter twin (valid "
                               f"convolutions only)")
            if any(int(v) != 1 for v in c.stride) or c.stride_h > 1 or c.stride_w > 1:
                raise CctError(f"{where}: convolution_param.stride must be 1 for a max-filter twin")
            dilation = _per_axis(c.dilation, nd, 1, "convolution_param.dilation", lp, source)
            new = [d * s for d, s in zip(dilation, sparsity)]
            del c.dilation[:]
            c.dilation.extend(new if len(set(new)) > 1 else new[:1])
        elif lp.type == "Pooling":
            kernel, _stride, _pad = _pool_fields(lp, nd, source)
            p = lp.pooling_param
            for name in ("stride", "stride_h", "stride_w"):
                p.ClearField(name)
            del p.stride_nd[:]
            p.stride_nd.append(1)
            del p.dilation_nd[:]
            p.dilation_nd.extend(sparsity if len(set(sparsity)) > 1 else sparsity[:1])
            sparsity = [s * k for s, k in zip(sparsity, kernel)]
        elif lp.type not in ELEMENTWISE:
            raise CctError(f"{where}: no max-filter twin for a {lp.type} layer (it does not act position "
                           f"by position)")
    if not out.name.endswith("_max_filter"):
        out.name = (out.name or "net") + "_max_filter"
    return out
