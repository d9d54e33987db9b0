"""Convolution by lowering to GEMM, batch-wide, with CcT's three lowerings (Hadjis et al. 2015, Fig. 6).

Input ``n×n×d`` (spatial × channels), kernel ``k×k×d×o``, output ``m×m×o``.  The spatial axes are split into
*lowered* axes L, replicated into the lowered matrix (im2col along L), and *lifted* axes F, whose kernel
offsets are summed after the GEMM as shifted slices ("lifting"):

    type 1, expensive lowering  (F = ∅)        lowered  (k²d, B·m²)   GEMM  (o, k²d)·(k²d, B·m²)   no lifting
    type 2, balanced            (F = 1st axis)  lowered  (kd,  B·n·m)  GEMM  (ko, kd)·(kd, B·n·m)   lift k slices
    type 3, expensive lifting   (F = all axes)  raw x    (d,   B·n²)   GEMM  (k²o, d)·(d, B·n²)     lift k² slices

In index form, with ``x`` padded along L only, ``col[c, k_L, b, i_F, o_L] = x[b, c, i_F, o_L·s + k_L·dil]``,
``W_m[g, k_F, o, c, k_L] = w[g·Og + o, c, k_F, k_L]``, ``Z = W_m · col`` (one GEMM per group over the whole
batch or partition) and ``y[b, o, o_F, o_L] = Σ_{k_F} Z[k_F, o, b, o_F + k_F·dil - pad, o_L]`` (rows outside the
input contribute nothing: padding along F costs no GEMM work).  The two backward passes are the adjoints of
the same steps, so each type keeps its trade-off (type 1 replicates the input, ∝ k²·d; type 3 the output
gradient, ∝ k²·o):

    unlift    dZ[k_F, o, b, i_F, o_L] = dy[b, o, i_F - k_F·dil + pad, o_L]   (zero outside; F = ∅: dZ = dy)
    weights   dW_m += dZ · colᵀ
    data      dcol = W_mᵀ · dZ,  dx = col2im_L(dcol)  (scatter-add of the k_L slices; F = all: a transposition)

On outputs of fewer than ``IMAGES_LAST_MAX_COLS`` cells per image, types 1 and 2 order the lowered columns
with the image innermost, ``col[c, k_L, i_F, o_L, b]`` (:func:`images_last_order`): each row copied while
lowering is then an output row times the images, not one short output row.  2-D layers lower and sum back
(col2im) by the compiled kernels of :mod:`cct.native` in either order: with the images innermost, one channel
at a time in a padded plane of every image's cells (CaffeNet's conv4 at 32 images, type 2: col2im 20.9 -> 5.6
ms, lowering 8.1 -> 6.7 ms; the digits LeNet's conv2 at 64: 280 -> 75 and 94 -> 55 us).

Type 1 on images first with big outputs runs one GEMM per image straight into the output; on float32 with AVX-512F
(or AVX2 and FMA) the forward may run on the compiled panel GEMM of :mod:`cct.native` instead (one group of 2-D
images: each image lowered span by span straight into its panels, no lowered matrix), and the weight gradient (one
group, 2-D) on its kernel that does the same with the lowered matrix's transpose — each where measured faster for
the geometry (:meth:`LoweringEngine._panel_forward`, :meth:`LoweringEngine._panel_weight_grad`): CaffeNet's conv1,
whose 96-row products OpenBLAS runs at 62-70% of its peak, forward 0.57-0.74x and weight gradient 0.70-0.84x BLAS's
time in the net.

Generalisations: groups (one GEMM per group), dilation (offsets ``k·dil``), N-D (balanced lifts the first
spatial axis and lowers the rest).  A lifted axis needs stride 1 (otherwise the GEMM would compute ``s``
times the rows it uses), so a strategy whose lifted axes have a stride > 1, type 2 with one spatial axis
and types 2/3 on a 1x1 kernel fall back to type 1; :func:`strategy_fallback` gives the reason, which
:attr:`LoweringEngine.reason` keeps.  Deconvolution runs the same engine with roles swapped.

The batch is split into partitions (:mod:`cct.runtime.partition`) run concurrently, each with its own
slice of the workspace; within a partition, images are processed in chunks whose lowered matrices fit
``max_lowered_bytes`` (the setting ``lowering_max_mb``, ``CCT_LOWERING_MAX_MB``, default 32 MiB in all, or
``PART_LOWERED_MAX_BYTES`` per core where that is more (:func:`chunk_budget_bytes`): chunks of some thousand
GEMM columns already run at full speed, and smaller buffers stay closer to the caches and keep the peak memory
down — CaffeNet B=64 trains as fast with 32 as with 128 MiB on 2 cores and holds 98 instead of 297 MiB of
workspace), and at most ``PART_LOWERED_MAX_BYTES`` per partition (:func:`partition_lowered_bytes`).  Arrays on a
device are lowered in chunks of :func:`cct.device.chunk_bytes` (CaffeNet's layers whole, each step one kernel over
the batch) unless a budget was given (``max_lowered_bytes``, ``lowering_max_mb``).

Workspace: the lowered matrix, the padded input, the GEMM result / unlifted gradient and the lifting buffer
live in a :class:`Workspace` (per partition, named flat buffers grown on demand) that every lowering engine
of a thread shares (:func:`shared_workspace`, one per thread, dtype and array module): a net runs its layers
one at a time, so its convolutions need only the largest layer's buffers × partitions, not one set each.
Within one call the passes reuse slots whose contents are dead (the unlifted gradient takes the GEMM
result's slot, the padded input gradient the padded input's).  Nothing survives from one call to the next.
The shared workspace lives as long as an engine that used it (weak registry); an engine built with its own
``workspace=Workspace()`` keeps private buffers (autotune measurements, tests).
"""
from __future__ import annotations

import itertools
import math
import threading
import weakref
from typing import Any

import numpy as np

from cct import native
from cct.config import settings
from cct.device import chunk_bytes, get_array_module
from cct.elementwise import relu_into
from cct.engines.base import ConvEngine, ConvGeometry, Estimate
from cct.engines.cost_model import DEFAULT_RATES, layer_costs, pass_seconds
from cct.engines.gemm import accumulates_in_place, gemm_threads, matmul_accumulate
from cct.runtime.partition import batch_ranges, in_partition, partitions_for_flops, run_batch, run_partitions
from cct.runtime.threads import cpu_cores

_DEFAULT_MAX_MB = 32.0
# a partition on the host lowers at most this many bytes at a time, whatever share of the budget it has: the
# lowered matrix is then still in the core's caches when its GEMMs read it (CaffeNet B=64, 2 partitions, interleaved:
# conv1 one image at a time instead of three, forward 56 -> 50 ms and weight gradient 62 -> 51 ms with AVX-512
# kernels, 5-7% with AVX2; conv4/conv5 at 13x13 in chunks of 8 images instead of 21, 3-7%; chunks of 2-4 images
# are slower again)
PART_LOWERED_MAX_BYTES = 6 << 20
# type 1 forward: one GEMM per image straight into the output when an image has at least this many columns
DIRECT_MIN_COLS = 128
# types 1 and 2 order the lowered columns with the images innermost below this many output cells per image
# (images_last_order); above it, at 27x27, both orders run as fast
IMAGES_LAST_MAX_COLS = 512
# col2im by contiguous shifts (LoweringEngine._col2im_flat) below this output width, stride and dilation 1: on
# 4-wide outputs 25% faster than a strided slice per kernel offset, even at 7, 10% slower at 8
FLAT_COL2IM_MAX_WIDTH = 6
# type 2 forward on the host with at least this many output columns per image (out rows x the lowered axes):
# the lifting sum done by the GEMMs themselves — per image, group and lifted kernel offset one GEMM adding
# (beta = 1) into the output rows that offset reaches, after the bias is written — so no GEMM buffer and no
# lifting or transposing pass (CaffeNet's conv2, 27x27 outputs: forward 11% faster; on its 13x13 layers the
# extra calls cost what the passes saved)
FUSED_LIFT_MIN_COLS = 512
# weight-gradient GEMMs (per group and chunk) of at least this many flops have their layout measured
WEIGHT_LAYOUT_MIN_FLOPS = 2e8
# pointwise layers of fewer output cells than this per image measure their GEMMs image by image against one GEMM
# over a chunk's images (LoweringEngine._pointwise_per_image): OpenBLAS's products of 49 columns (7x7 outputs) run
# well below its rate on wide ones — per image a 1024 x 1024 layer's backward took 1.4x the time of the batched
# GEMMs — where 64 columns (8x8) run at full speed per image (the batched ones then 1.15-1.3x slower)
POINTWISE_BATCH_MAX_COLS = 100
# products (per chunk of images: MobileNet's conv1, 22 MFLOP an image, forward 0.69x BLAS's time by the panels on
# chunks of 3) of fewer flops keep BLAS without measuring the compiled panel GEMMs: their measurement would cost
# more than they could save
PANEL_MIN_FLOPS = 5e7
# a measured choice between BLAS and the compiled panel GEMM times this many products a run: one (a few ms) is
# within the shared machine's noise of a 10% difference
PANEL_MEASURE_PRODUCTS = 8
# forward keeps its lowered matrix for backward's weight gradient when the whole batch's is at most this big
# (small layers, where lowering costs as much as the GEMMs), no smaller than the input it keeps a copy of (a
# strided 1x1 kernel lowers a quarter of its input: ResNet-50's res4a_branch2a, 10 images, forward 2.1 ms
# without keeping, 4.5-6.2 with) and the engine has computed a weight gradient before (inference keeps
# nothing); reused only while its input is bitwise unchanged
KEEP_LOWERED_MAX_BYTES = 4 << 20

STRATEGY_NAMES = {1: "expensive lowering", 2: "balanced", 3: "expensive lifting"}


def images_first_copy(dst: Any, src: Any, bias: Any | None = None, rectify: bool = False) -> None:
    """``dst`` (n, C, *cells) = ``src`` (C, *cells, n) moved, plus ``bias`` (C,) per channel when given, then
    (``rectify``) ``max(dst, 0)`` as the ReLU layer's — by the compiled tiled transposition where it takes the arrays
    (numpy's strided copy ran 2-7x a plain copy's time; it rectifies each row as it writes it)."""
    n = dst.shape[0]
    compiled = native.kernels_for(dst, src, *(() if bias is None else (bias,)))
    if compiled is not None and n:
        rows = src.size // n
        compiled.transpose(src, dst, rows, n, bias, max(1, rows // max(1, dst.shape[1])), rectify)
        return
    xp = get_array_module(dst)
    moved = xp.moveaxis(src, -1, 0)
    if bias is None:
        xp.copyto(dst, moved)
    else:
        xp.add(moved, bias.reshape((len(bias),) + (1,) * (dst.ndim - 2)), out=dst)
    if rectify:
        relu_into(dst, dst)


def lifted_axes(strategy: int, num_spatial: int) -> int:
    """How many leading spatial axes a strategy lifts (the others are lowered)."""
    return {1: 0, 2: 1, 3: num_spatial}[strategy]


def strategy_fallback(strategy: int, g: ConvGeometry) -> str | None:
    """Why ``strategy`` does not apply to ``g`` (then type 1 runs), or None."""
    if strategy == 1:
        return None
    nd = g.num_spatial_axes
    if nd == 0:
        return "no spatial axes"
    if strategy == 2 and nd == 1:
        return "1 spatial axis"
    if all(k == 1 for k in g.kernel):
        return "1x1 kernel"
    f = lifted_axes(strategy, nd)
    if any(s != 1 for s in g.stride[:f]):
        return "stride " + "x".join(str(s) for s in g.stride[:f])
    return None


def chunk_budget_bytes() -> int:
    """The per-call scratch budget of the convolution engines, in bytes, for all batch partitions together: the
    ``lowering_max_mb`` setting, else 32 MiB or ``PART_LOWERED_MAX_BYTES`` per core, whichever is more.  A fixed
    32 MiB split 16 ways left a partition 2 MiB: CaffeNet's conv3-conv5 lowered 1-2 images at a time instead of
    4-8, 3-12% slower per core (one thread, AVX-512 kernels, fwd+bwd of 8 images: conv5 type 1 26.1 vs 23.0 ms)."""
    mb = settings.get("lowering_max_mb")
    if mb is not None:
        return int(mb * 2**20)
    return max(int(_DEFAULT_MAX_MB * 2**20), cpu_cores() * PART_LOWERED_MAX_BYTES)


def partition_lowered_bytes(total: int, parts: int, host: bool = True) -> int:
    """What one of ``parts`` batch partitions may lower at a time out of ``total`` bytes for all of them: on the
    host at most :data:`PART_LOWERED_MAX_BYTES` (a core's caches), on a device its whole share."""
    share = max(1, total // parts)
    return min(share, PART_LOWERED_MAX_BYTES) if host else share


class Workspace:
    """Scratch buffers of lowering engines: per partition, named flat arrays grown on demand (never
    shrunk).  Engines sharing one must not run concurrently — a net's layers run one after the other."""

    def __init__(self) -> None:
        self.parts: list[dict[str, Any]] = []

    def part(self, i: int) -> dict[str, Any]:
        while len(self.parts) <= i:
            self.parts.append({})
        return self.parts[i]

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for part in self.parts for b in part.values())

    def clear(self) -> None:
        """Release every buffer (they are re-allocated by the next call that needs them)."""
        self.parts = []


def workspace_view(ws: dict[str, Any], name: str, shape: tuple[int, ...], like: Any) -> Any:
    """A ``shape`` view of the flat buffer ``name`` of one partition's buffers ``ws`` (``Workspace.part(i)``),
    grown when too small, of ``like``'s dtype and array module; its contents are whatever the last user
    left."""
    count = math.prod(shape)
    buf = ws.get(name)
    xp = get_array_module(like)
    if buf is None or buf.size < count or buf.dtype != like.dtype or get_array_module(buf) is not xp:
        ws.pop(name, None)  # drop the old buffer before allocating its replacement
        buf = xp.empty(max(count, 1), dtype=like.dtype)
        ws[name] = buf
    return buf[:count].reshape(shape)


_registry = threading.local()  # per thread: (dtype, array module) -> weakref to the shared Workspace
_all_shared: weakref.WeakSet[Workspace] = weakref.WeakSet()


def shared_workspace(dtype: Any = np.float32, xp: Any = np) -> Workspace:
    """The calling thread's workspace shared by lowering engines working on ``dtype`` arrays of ``xp``."""
    table = getattr(_registry, "table", None)
    if table is None:
        table = _registry.table = {}
    key = (np.dtype(dtype).str, getattr(xp, "__name__", None) or str(xp))
    ref = table.get(key)
    ws = ref() if ref is not None else None
    if ws is None:
        ws = Workspace()
        table[key] = weakref.ref(ws)
        _all_shared.add(ws)
    return ws


def shared_workspace_bytes() -> int:
    """Bytes held by every live shared workspace (all threads)."""
    return sum(ws.nbytes() for ws in list(_all_shared))


def _geometry_key(g: ConvGeometry) -> str:
    """A convolution's geometry but its batch, for the keys of measured choices."""
    def dims(t: tuple[int, ...]) -> str:
        return "x".join(map(str, t))
    return (f"c{g.in_channels}-i{dims(g.in_shape)}-o{g.out_channels}-g{g.group}-k{dims(g.kernel)}-s{dims(g.stride)}"
            f"-p{dims(g.pad)}-d{dims(g.dilation)}")


def images_last_order(lay: _Layout) -> bool:
    """Whether ``lay`` orders its lowered columns (*in_F, *out_L, image) instead of (image, *in_F, *out_L), types 1
    and 2 on outputs of fewer than ``IMAGES_LAST_MAX_COLS`` cells per image: copying a kernel offset's rows
    then moves runs of (output row x images) instead of one short output row each, for transposing the input,
    the output and its gradient as (items, images) matrices.  The digits LeNet's conv2 (4x4 outputs) lowers 64
    images in 14 instead of 168 us.  Measured forward + backward on 2 cores (AVX-512 kernels, against the
    images-first layout with its per-image GEMMs where they apply): type 1 0.57-0.86x on 3x3 layers of 4x4 to
    8x8 images, 0.88-0.92x on CaffeNet-sized 13x13 layers, 0.91-0.93x on 16x16 and 20x20 ones, as fast as
    each other on 27x27 (hence the bound); type 2 0.97-0.99x on 13x13.  Only where the lowered rows outnumber
    the output channels and a kernel has several lowered offsets: 1.19x on the digits' 1 -> 20 channel conv1,
    1.10-1.15x on 1x1 layers of 7x7 images (whose lowering is a transposition either way)."""
    if lay.KL <= 1 or lay.K < lay.Og or lay.f > 1 or (lay.f == 1 and not lay.outL):
        return False
    return lay.out_count < IMAGES_LAST_MAX_COLS


def lifts_per_image(g: ConvGeometry, strategy: int, dtype: Any = np.float32, xp: Any = np) -> bool:
    """Whether ``strategy`` runs its lifting sums as GEMMs image by image on ``g`` (``FUSED_LIFT_MIN_COLS``):
    type 2 on wide host outputs with the images first, its forward and its data gradient one GEMM per image,
    group and lifted kernel offset (:meth:`LoweringEngine._forward_lifting_gemms`, ``_data_grad_by_rows``)."""
    return strategy_fallback(strategy, g) is None and _lifts_per_image(_Layout(g, strategy), g, dtype, xp)


def _lifts_per_image(lay: _Layout, g: ConvGeometry, dtype: Any, xp: Any) -> bool:
    return lay.f == 1 and not lay.images_last and xp is np and g.out_count >= FUSED_LIFT_MIN_COLS \
        and accumulates_in_place(dtype)


def lowers_images_last(g: ConvGeometry, strategy: int) -> bool:
    """Whether ``strategy`` (which must apply to ``g``) lowers ``g`` with the images innermost."""
    return _Layout(g, strategy).images_last


class _Layout:
    """Shapes of one geometry under one strategy (per image counts; ``f`` lifted leading axes)."""

    def __init__(self, g: ConvGeometry, strategy: int):
        nd = g.num_spatial_axes
        self.f = f = lifted_axes(strategy, nd)
        self.G, self.C, self.O = g.group, g.in_channels, g.out_channels
        self.Cg, self.Og = self.C // self.G, self.O // self.G
        self.kF, self.kL = g.kernel[:f], g.kernel[f:]
        self.KF, self.KL = math.prod(self.kF), math.prod(self.kL)
        self.inF, self.outF, self.outL = g.in_shape[:f], g.out_shape[:f], g.out_shape[f:]
        self.out_count = g.out_count
        self.padL = g.pad[f:]
        # lowered column count per image: F axes at input resolution, L axes at output resolution
        self.cols = math.prod(self.inF) * math.prod(self.outL)
        self.K = self.Cg * self.KL
        self.M = self.KF * self.Og
        self.lift = self._lift_plan(g) if f else []
        # type 1 of a 1x1 kernel without padding: each image's lowered matrix is the image itself (stride 1: its
        # GEMMs read x and write y where they lie, LoweringEngine._pointwise_forward, as Caffe's 1x1 case does) or,
        # strided, its subsample: one strided copy of the cells the outputs read, in the images' own layout
        self.pointwise = not f and self.KL == 1 and not any(g.pad)
        self.subsampled = self.pointwise and any(s > 1 for s in g.stride)
        self.images_last = images_last_order(self)

    def col_shape(self, n: int) -> tuple[int, ...]:
        """The lowered matrix of ``n`` images as an array: (C, *k_L, n, *in_F, *out_L), or with
        :attr:`images_last` (C, *k_L, *in_F, *out_L, n)."""
        if self.images_last:
            return (self.C,) + self.kL + self.inF + self.outL + (n,)
        return (self.C,) + self.kL + (n,) + self.inF + self.outL

    def z_shape(self, n: int) -> tuple[int, ...]:
        """The GEMM result (and the unlifted gradient) of ``n`` images as an array: (G, KF, Og, n, *in_F,
        *out_L), or with :attr:`images_last` (G, KF, Og, *in_F, *out_L, n)."""
        cols = self.inF + self.outL
        return (self.G, self.KF, self.Og) + ((cols + (n,)) if self.images_last else ((n,) + cols))

    def yt_shape(self, n: int, out_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The channel-first output (G, Og, n, *out), or with :attr:`images_last` (G, Og, *out, n)."""
        return (self.G, self.Og) + ((out_shape + (n,)) if self.images_last else ((n,) + out_shape))

    def _lift_plan(self, g: ConvGeometry) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...], bool]]:
        """Per lifted kernel offset: (flat index, output slices, input slices, covers the whole output),
        over the F axes; offsets whose rows all fall outside the input are dropped."""
        plan = []
        for flat, t in enumerate(itertools.product(*(range(k) for k in self.kF))):
            dst, src, full = [], [], True
            for a, ka in enumerate(t):
                off = ka * g.dilation[a] - g.pad[a]
                i0, i1 = max(0, -off), min(g.out_shape[a], g.in_shape[a] - off)
                if i1 <= i0:
                    break
                dst.append(slice(i0, i1))
                src.append(slice(i0 + off, i1 + off))
                full &= i0 == 0 and i1 == g.out_shape[a]
            else:
                plan.append((flat, tuple(dst), tuple(src), full))
        plan.sort(key=lambda e: not e[3])  # a full-coverage offset first: it assigns instead of adding
        return plan


class LoweringEngine(ConvEngine):
    """CcT lowering (type 1, 2 or 3; see the module docstring), batch-wide, partitioned, N-D, numpy/cupy.

    ``strategy``: 1, 2 or 3 (falling back to 1 where it does not apply); the choice per layer is the policy's
    (:mod:`cct.engines.choice`), which asks for one with :meth:`request` before :meth:`configure`.  After
    :meth:`configure`, :attr:`strategy` is the lowering that runs and :attr:`reason` says why.
    ``workspace``: private buffers (default: the thread's :func:`shared_workspace`).
    """

    name = "lowering"

    def __init__(self, strategy: int = 1, max_lowered_bytes: int | None = None, source: str = "forced",
                 workspace: Workspace | None = None):
        super().__init__()
        self.max_lowered_bytes = chunk_budget_bytes() if max_lowered_bytes is None else max_lowered_bytes
        self._budget_given = max_lowered_bytes is not None or settings.get("lowering_max_mb") is not None
        self._xp: Any = np  # the array module of the configured geometry's arrays
        self.requested = 1
        self.source = source
        self.request(strategy, source)
        self.strategy = 1
        self.reason = "default"
        self.dtype: Any = np.dtype(np.float32)
        self._layout: _Layout | None = None
        self._private = workspace
        self._shared: dict[tuple[str, str], Workspace] = {}  # strong references keep shared workspaces alive
        self._current: Workspace | None = None
        self._chunk_memo: dict[tuple[int, int, Any], list[list[tuple[int, int]]]] = {}
        # per image range: (layout, copy of the input, lowered matrix) kept by forward (small layers only)
        # once a weight gradient has been asked for (never for an engine that only runs forward)
        self._kept: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self._trains = False
        self._layouts: dict[str, str] = {}  # measured GEMM layouts per chunk shape (weight gradient, pointwise)

    # ---- cost ----------------------------------------------------------------------------------
    @classmethod
    def estimates(cls, g: ConvGeometry, dtype: Any = "float32", rates: Any = None, xp: Any = None) -> list[Estimate]:
        """Each applicable lowering's predicted forward and backward seconds (:mod:`cct.engines.cost_model`
        with the layer's batch partitions) and workspace: per partition, the lowered matrix and the GEMM
        result of one chunk of images (chunks keep the lowered matrices within ``max_lowered_bytes``)."""
        itemsize = np.dtype(dtype).itemsize
        rates = rates or DEFAULT_RATES
        parts = partitions_for_flops(g.num, 2.0 * g.out_channels * (g.in_channels // g.group) * g.kernel_count
                                     * g.out_count)
        budget = partition_lowered_bytes(chunk_budget_bytes(), parts)
        out = []
        for s in (1, 2, 3):
            if strategy_fallback(s, g) is not None:
                continue
            lay = _Layout(g, s)
            lowered, result = (lay.C * lay.cols * lay.subsampled, 0) if lay.pointwise else \
                (lay.C * lay.KL * lay.cols, lay.KF * lay.O * lay.cols)
            per_image = max(lowered, result) * itemsize
            images = max(1, min(-(-g.num // parts), budget // max(per_image, 1)))
            forward, backward = pass_seconds(layer_costs(g, s, itemsize, lifts_per_image(g, s, dtype, xp or np)),
                                             rates, parts)
            out.append(Estimate("lowering", f"lowering {s}", forward, backward,
                                int(parts * images * (lowered + result) * itemsize)))
        return out

    # ---- configuration -------------------------------------------------------------------------
    def request(self, strategy: int, source: str = "forced") -> None:
        """Run ``strategy`` (1, 2 or 3) from the next :meth:`configure` on; ``source`` says why (logs).  A
        strategy that does not apply to a geometry falls back to type 1 there, saying why."""
        if strategy not in (1, 2, 3):
            raise ValueError(f"lowering strategy must be 1, 2 or 3 (got {strategy!r})")
        if (strategy, source) != (self.requested, self.source):
            self.requested, self.source = strategy, source
            self._layout = None

    def configure(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        """Adopt ``geometry`` with the requested strategy; True when the plan changed.  Any array module."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        self._xp = np if xp is None else xp
        if geometry == self.geometry and dtype == self.dtype and self._layout is not None:
            return False
        self.geometry, self.dtype = geometry, dtype
        why = strategy_fallback(self.requested, geometry)
        strategy, reason = (1, f"fallback: {why}") if why else (self.requested, self.source)
        changed = (strategy, reason) != (self.strategy, self.reason) or self._layout is None
        self.set_strategy(strategy, reason)
        return changed

    def set_strategy(self, strategy: int, reason: str = "forced") -> None:
        """Run ``strategy`` on the configured geometry (it must apply: see :func:`strategy_fallback`)."""
        g = self._geom()
        why = strategy_fallback(strategy, g)
        if why:
            raise ValueError(f"lowering {strategy} does not apply to this geometry: {why}")
        self.strategy, self.reason = strategy, reason
        self._layout = _Layout(g, strategy)
        self._chunk_memo = {}

    def describe(self) -> str:
        """``lowering 1 (cost model)``, plus the passes of the configured geometry measured faster on the compiled
        panel GEMMs (:meth:`_panel_forward`, :meth:`_panel_weight_grad`), once they have run."""
        text = f"lowering {self.strategy} ({self.reason})"
        if self.geometry is None:
            return text
        geometry = _geometry_key(self._geom())
        passes = [name for name, prefix in (("forward", "panel-fwd-"), ("weight gradient", "panel-wgrad-"))
                  if any(key.startswith(prefix + geometry + "-n") and way == "panels"
                         for key, way in self._layouts.items())]
        return f"{text}; panel GEMM: {', '.join(passes)}" if passes else text

    def batch_partitions(self) -> int:
        return len(self._chunks(self._geom().num, self.dtype.itemsize))

    def workspace_bytes(self) -> int:
        """Bytes held in the workspace(s) this engine uses, all partitions — shared ones included in full
        (engines of one thread share them: do not add the figures of several engines up)."""
        spaces = [self._private] if self._private is not None else list(self._shared.values())
        return sum(ws.nbytes() for ws in spaces)

    @property
    def workspace(self) -> Workspace:
        """The workspace of the last call (before any: the one a call on ``self.dtype`` arrays would use)."""
        if self._current is None:
            return self._space_for(self.dtype, np)
        return self._current

    @property
    def _ws(self) -> list[dict[str, Any]]:
        """Per partition, the named buffers of :attr:`workspace` (inspection and tests)."""
        return self.workspace.parts

    # ---- buffers -----------------------------------------------------------------------------
    def _geom(self) -> ConvGeometry:
        if self.geometry is None:
            raise RuntimeError("LoweringEngine used before configure()")
        return self.geometry

    def _lay(self) -> _Layout:
        if self._layout is None:
            self.configure(self._geom())
        assert self._layout is not None
        return self._layout

    def _space_for(self, dtype: Any, xp: Any) -> Workspace:
        if self._private is not None:
            return self._private
        ws = shared_workspace(dtype, xp)
        self._shared[(np.dtype(dtype).str, getattr(xp, "__name__", None) or str(xp))] = ws
        return ws

    def _space(self, like: Any) -> Workspace:
        """The workspace for a call on arrays like ``like`` (remembered as :attr:`workspace`)."""
        self._current = ws = self._space_for(like.dtype, get_array_module(like))
        return ws

    _view = staticmethod(workspace_view)

    def _chunks(self, n: int, itemsize: int, xp: Any = None) -> list[list[tuple[int, int]]]:
        """Per partition, the image ranges processed one after the other (lowered matrices within budget, see
        :func:`partition_lowered_bytes`; ``xp``: the arrays' module, by default the configured one's)."""
        xp = self._xp if xp is None else xp
        host = xp is np
        key = (n, itemsize, settings.get("partitions"), in_partition(), host)
        memo = self._chunk_memo.get(key)
        if memo is not None:
            return memo
        L = self._lay()
        per_image = max(L.C * L.KL * L.cols, L.KF * L.O * L.cols) * itemsize
        # a device runs its share as one stream of kernels: host threads launching into it add nothing
        parts = partitions_for_flops(n, 2.0 * L.M * L.K * L.cols) if host else 1
        total = self.max_lowered_bytes if self._budget_given else chunk_bytes(xp, self.max_lowered_bytes)
        budget = partition_lowered_bytes(total, parts, host)
        out = []
        for n0, n1 in batch_ranges(n, parts):
            step = max(1, min(n1 - n0, budget // max(per_image, 1)))
            out.append([(a, min(a + step, n1)) for a in range(n0, n1, step)] or [(n0, n1)])
        self._chunk_memo[key] = out
        return out

    def chunk_images(self) -> int:
        """Images one partition processes at a time on the configured geometry (what one GEMM covers)."""
        chunks = self._chunks(self._geom().num, self.dtype.itemsize)
        return min(n1 - n0 for part in chunks for n0, n1 in part[:1])

    def probe(self, x: Any, dy: Any) -> dict[str, Any]:
        """This engine's own data-movement steps on the configured geometry, each a callable running it once
        on ``x`` (the input) and ``dy`` (an output gradient) in a private partition of the workspace — what
        the cost model's rates are calibrated on (:func:`cct.engines.autotune.calibrate`):

        * ``"lower"`` — writing the lowered matrix (types 1 and 2);
        * ``"col2im"`` — adding a lowered matrix back into an input gradient (types 1 and 2);
        * ``"transpose"`` — ``dy`` to the GEMM's channel-first layout (and unlifting it, types 2 and 3);
        * ``"lift"`` — lifting an unlifted gradient back, plus ``"transpose"`` (types 2 and 3)."""
        ws = self.workspace.part(0)
        steps: dict[str, Any] = {"transpose": lambda: self._grad_z(ws, dy)}
        lay = self._lay()
        if lay.f < self._geom().num_spatial_axes:
            # col2im reads the lowered matrix where "lower" writes it (the same values every time; col2im's own
            # slots are others): no copy beside the workspace's (29 MB a partition in the calibration)
            col, dx = self._lower(ws, x), np.empty_like(x)
            steps["lower"] = lambda: self._lower(ws, x)
            steps["col2im"] = lambda: self._col2im(ws, col, dx)
        if lay.f:
            g = self._geom()
            z = self._grad_z(ws, dy).copy().reshape(lay.z_shape(g.num))
            yt = np.empty(lay.yt_shape(g.num, g.out_shape), dtype=z.dtype)

            def lift() -> None:
                self._lift(z, yt)
                self._grad_z(ws, dy)
            steps["lift"] = lift
        return steps

    def _partitions(self, itemsize: int) -> list[tuple[int, int]]:
        """All image ranges of a full batch, in order (for inspection and tests)."""
        return [r for part in self._chunks(self._geom().num, itemsize) for r in part]

    def _run(self, space: Workspace, chunks: list[list[tuple[int, int]]], body: Any) -> int:
        """``body(ws, part, n0, n1)`` over every chunk, partitions concurrently; returns #partitions."""
        parts = [space.part(i) for i in range(len(chunks))]

        def run_part(part: int, _a: int, _b: int) -> None:
            ws = parts[part]
            for n0, n1 in chunks[part]:
                body(ws, part, n0, n1)

        L = self._lay()
        images = max(n1 - n0 for c in chunks for n0, n1 in c)
        with gemm_threads(2.0 * L.M * L.K * L.cols * images):  # per GEMM (a group of a chunk)
            run_partitions([(c[0][0], c[-1][1]) for c in chunks], run_part)
        return len(chunks)

    # ---- weights in the GEMM layout ------------------------------------------------------------
    def _weight_matrix(self, w: Any) -> Any:
        """``W_m`` (G, KF·Og, Cg·KL); a view of ``w`` for type 1, else a (small) transposed copy."""
        L = self._lay()
        if L.f == 0:
            return w.reshape(L.G, L.M, L.K)
        wm = w.reshape(L.G, L.Og, L.Cg, L.KF, L.KL).transpose(0, 3, 1, 2, 4)
        return get_array_module(w).ascontiguousarray(wm).reshape(L.G, L.M, L.K)

    def _add_weight_grad(self, dw: Any, dwmt: Any) -> None:
        """``dw += dW_m`` given its transpose ``dwmt`` (G, K, M), mapped back from the GEMM layout."""
        L = self._lay()
        if L.f == 0:
            dw.reshape(L.G, L.M, L.K)[...] += dwmt.transpose(0, 2, 1)
        else:
            dw.reshape(L.G, L.Og, L.Cg, L.KF, L.KL)[...] += dwmt.reshape(
                L.G, L.Cg, L.KL, L.KF, L.Og).transpose(0, 4, 1, 3, 2)

    # ---- lowering and lifting -----------------------------------------------------------------
    def _padded_input(self, ws: dict[str, Any], x: Any) -> Any:
        """``x`` zero-padded along the lowered axes (F axes are never padded)."""
        g, L = self._geom(), self._lay()
        if not any(L.padL):
            return x
        n, f = x.shape[0], L.f
        sizes = g.in_shape[f:]
        shape = (n, L.C) + L.inF + tuple(i + 2 * p for i, p in zip(sizes, L.padL))
        buf = self._view(ws, "x_pad", shape, x)  # a shared slot: its border is not zero from a previous use
        lead = (slice(None),) * (2 + f)
        for a, (i, p) in enumerate(zip(sizes, L.padL)):
            if p:
                rest = (slice(None),) * (len(sizes) - a - 1)
                buf[lead + (slice(None),) * a + (slice(0, p),) + rest] = 0
                buf[lead + (slice(None),) * a + (slice(p + i, None),) + rest] = 0
        buf[lead + tuple(slice(p, p + i) for i, p in zip(sizes, L.padL))] = x
        return buf

    def _images_last(self, ws: dict[str, Any], x: Any) -> Any:
        """``x`` (n, C, *in) as (C, *in, n), zero-padded along the lowered axes (in the padded input's slot)."""
        L = self._lay()
        sizes = x.shape[2:]
        pads = (0,) * L.f + L.padL
        buf = self._view(ws, "x_pad", (L.C,) + tuple(i + 2 * p for i, p in zip(sizes, pads)) + (x.shape[0],), x)
        for a, (i, p) in enumerate(zip(sizes, pads)):  # a shared slot: its border is not zero from a previous use
            if p:
                lead, rest = (slice(None),) * (1 + a), (slice(None),) * (len(sizes) - a)
                buf[lead + (slice(0, p),) + rest] = 0
                buf[lead + (slice(p + i, None),) + rest] = 0
        inner = (slice(None),) + tuple(slice(p, p + i) for i, p in zip(sizes, pads))
        get_array_module(x).copyto(buf[inner], get_array_module(x).moveaxis(x, 0, -1))
        return buf

    def _lower(self, ws: dict[str, Any], x: Any, out: Any | None = None, images_last: bool | None = None) -> Any:
        """``col`` (C, *k_L, n, *in_F, *out_L) from ``x`` (n, C, *in), into ``out`` or the workspace; with
        :attr:`_Layout.images_last` (``images_last`` overrides) ``col`` (C, *k_L, *in_F, *out_L, n).  2-D
        images run the compiled im2col of :mod:`cct.native` (images first or last) where it takes the arrays
        (the same copy)."""
        g, L = self._geom(), self._lay()
        xp = get_array_module(x)
        n, f, nd = x.shape[0], L.f, g.num_spatial_axes
        if L.images_last if images_last is None else images_last:
            if out is None:
                out = self._view(ws, "col", self._lowered_shape(n, True), x)
            compiled = native.kernels()
            if compiled is not None and nd == 2 and native.takes(x, out):
                self._compiled_lowering(compiled, x, out, True)
                return out
            src = self._images_last(ws, x)
            st = src.strides
            xp.copyto(out, xp.lib.stride_tricks.as_strided(
                src, shape=out.shape,
                strides=(st[0],) + tuple(st[1 + a] * g.dilation[a] for a in range(f, nd)) + st[1:1 + f]
                + tuple(st[1 + a] * g.stride[a] for a in range(f, nd)) + (st[-1],)))
            return out
        if out is None:
            out = self._view(ws, "col", self._lowered_shape(n, False), x)
        if f == nd:
            xp.copyto(out, xp.moveaxis(x, 0, 1))
            return out
        compiled = native.kernels()
        if compiled is not None and nd == 2 and native.takes(x, out):
            self._compiled_lowering(compiled, x, out, False)
            return out
        src = self._padded_input(ws, x)
        nl = nd - f
        if any(s > 1 for s in g.stride[f:]) and all(d == 1 for d in g.dilation[f:]) and out.flags.c_contiguous:
            return self._lower_phases(ws, src, out)
        st = src.strides
        window = xp.lib.stride_tricks.as_strided(
            src,
            shape=(n, L.C) + L.inF + L.outL + L.kL,
            strides=st[:2 + f] + tuple(st[2 + f + i] * g.stride[f + i] for i in range(nl))
            + tuple(st[2 + f + i] * g.dilation[f + i] for i in range(nl)))
        order = (1,) + tuple(range(2 + nd, 2 + nd + nl)) + (0,) + tuple(range(2, 2 + nd))
        xp.copyto(out, window.transpose(order))
        return out

    def _compiled_lowering(self, compiled: Any, x: Any, out: Any, last: bool) -> None:
        """The compiled im2col of ``x`` into ``out`` (images first, or ``last``: for one image the same bytes, and
        lowered as images first, whole rows at a time); one image outside the batch partitions (inference of one
        image: the batch has one partition) has its channels lowered over the cores, each range of channels into
        its own rows of ``out`` (the same copies)."""
        n, channels = x.shape[:2]
        geometry = self._lowering_geometry(n)
        last = last and n > 1
        if n != 1 or in_partition():  # (a chunk of a partition: lowered as it is, no split asked for)
            compiled.lowering(x, out, geometry, False, last)
            return
        run_batch(channels, lambda _p, c0, c1: compiled.lowering(
            x[:, c0:c1], out[c0:c1], (n, c1 - c0) + geometry[2:], False, last), work=out.size / max(channels, 1))

    def _lowered_shape(self, n: int, images_last: bool | None = None) -> tuple[int, ...]:
        """The shape of :meth:`_lower`'s ``col`` for ``n`` images (``images_last`` overrides the layout's)."""
        L = self._lay()
        if L.images_last if images_last is None else images_last:
            return L.col_shape(n)
        return (L.C,) + L.kL + (n,) + L.inF + L.outL

    def _lowering_geometry(self, n: int) -> tuple[int, ...]:
        """The compiled 2-D lowering's geometry (images first or last) for ``n`` images: n, C, H, W, then kernel,
        stride, pad and dilation as (rows, columns), then the output rows and columns.  Type 1 lowers both axes;
        type 2 lowers each row along the last axis and keeps every row: a one-row kernel, output rows = input
        rows."""
        g, L = self._geom(), self._lay()
        head = (n, L.C) + g.in_shape
        if L.f == 0:
            return head + g.kernel + g.stride + g.pad + g.dilation + g.out_shape
        return head + (1, g.kernel[1], 1, g.stride[1], 0, g.pad[1], 1, g.dilation[1], g.in_shape[0], g.out_shape[1])

    def _lower_phases(self, ws: dict[str, Any], src: Any, out: Any) -> Any:
        """:meth:`_lower` for strided lowered axes (dilation 1) from the padded input ``src``, split first into
        its stride phases (``phase[r][..., j] = src[..., j·s + r]`` per lowered axis): kernel offset
        ``k = s·q + r`` then reads phase ``r`` from ``q + o``, so each output row of each offset is one
        contiguous run, and all offsets go in at most ``2^L`` copies (per axis, the ``⌊k/s⌋·s`` offsets of whole
        phase cycles and the remaining ``k mod s``).  CaffeNet's conv1 (11x11, stride 4) lowers 32 images (in its
        3-image chunks, one thread) in 7 instead of 10 ms: the strided gathers of 55-cell rows were the cost."""
        g, L = self._geom(), self._lay()
        xp = get_array_module(src)
        f, n = L.f, src.shape[0]
        strides, sizes = g.stride[f:], src.shape[2 + f:]
        extents = tuple(-(-p // s) for p, s in zip(sizes, strides))
        nl = len(strides)
        phases = self._view(ws, "x_phase", strides + (n, L.C) + L.inF + extents, src)
        lead = (slice(None),) * (2 + f)
        for r in itertools.product(*(range(s) for s in strides)):
            cells = tuple(slice(ri, None, s) for ri, s in zip(r, strides))
            part = src[lead + cells]
            phases[r + lead + tuple(slice(0, m) for m in part.shape[2 + f:])] = part
        ps, os_ = phases.strides, out.strides
        elem = ps[nl + 2 + f:]  # one cell along each lowered axis of a phase
        kstep = os_[1:1 + nl]  # out: (C, *k_L, n, *in_F, *out_L)
        blocks = []
        for k, s in zip(L.kL, strides):  # per axis: (first q, q count, r count) of offsets k = s·q + r
            blocks.append([(0, k // s, s)] * (k >= s) + [(k // s, 1, k % s)] * (k % s > 0))
        flat_src, flat_dst = phases.reshape(-1), out.reshape(-1)
        for combo in itertools.product(*blocks):
            shape = (L.C,) + tuple(v for _, qn, rn in combo for v in (qn, rn)) + (n,) + L.inF + L.outL
            src_at = sum(q0 * e for (q0, _, _), e in zip(combo, elem)) // phases.itemsize
            dst_at = sum(q0 * s * ks for (q0, _, _), s, ks in zip(combo, strides, kstep)) // out.itemsize
            src_view = xp.lib.stride_tricks.as_strided(
                flat_src[src_at:], shape=shape,
                strides=(ps[nl + 1],) + tuple(v for e, ph in zip(elem, ps[:nl]) for v in (e, ph))
                + (ps[nl],) + ps[nl + 2:nl + 2 + f] + elem)
            dst_view = xp.lib.stride_tricks.as_strided(
                flat_dst[dst_at:], shape=shape,
                strides=(os_[0],) + tuple(v for s, ks in zip(strides, kstep) for v in (s * ks, ks)) + os_[1 + nl:])
            xp.copyto(dst_view, src_view)
        return out

    def _col2im(self, ws: dict[str, Any], col: Any, dx: Any, images_last: bool | None = None) -> Any:
        """Adjoint of :meth:`_lower`: ``dx`` (n, C, *in) = Σ of every col entry into the cell it came from.
        The sum runs channel-first (C, n, *in_F, *padded L; with images last, (C, *padded, n)) — col's own
        order, so every slice addition walks both arrays in the same order — and is transposed into ``dx``
        once at the end; with unit strides along the lowered axes (images first) it goes straight into
        ``dx`` (:meth:`_col2im_into`).  2-D images run the compiled col2im of :mod:`cct.native` (images first or
        last) where it takes the arrays (the same sums in the same order)."""
        g, L = self._geom(), self._lay()
        xp = get_array_module(dx)
        n, f, nd = dx.shape[0], L.f, g.num_spatial_axes
        if f == nd:
            xp.copyto(dx, xp.moveaxis(col, 0, 1))
            return dx
        sizes = g.in_shape[f:]
        compiled = native.kernels()
        if L.images_last if images_last is None else images_last:
            if compiled is not None and nd == 2 and native.takes(col, dx):
                compiled.lowering(col, dx, self._lowering_geometry(n), True, True)
                return dx
            target = self._view(ws, "x_pad", (L.C,) + L.inF + tuple(i + 2 * p for i, p in zip(sizes, L.padL))
                                + (n,), dx)
            target.fill(0)
            lead = (slice(None),) * (1 + f)
            for off in itertools.product(*(range(k) for k in L.kL)):
                cells = tuple(slice(o * d, o * d + s * (m - 1) + 1, s)
                              for o, d, s, m in zip(off, g.dilation[f:], g.stride[f:], L.outL))
                target[lead + cells] += col[(slice(None),) + off]
            inner = lead + tuple(slice(p, p + i) for i, p in zip(sizes, L.padL))
            xp.copyto(dx, xp.moveaxis(target[inner], -1, 0))
            return dx
        if compiled is not None and nd == 2 and native.takes(col, dx):
            compiled.lowering(col, dx, self._lowering_geometry(n), True, False)
            return dx
        unit = all(s == 1 for s in g.stride[f:])
        flat = unit and L.outL[-1] < FLAT_COL2IM_MAX_WIDTH and all(d == 1 for d in g.dilation[f:])
        if unit and not flat:
            self._col2im_into(col, xp.moveaxis(dx, 0, 1))
            return dx
        shape = (L.C, n) + L.inF + tuple(i + 2 * p for i, p in zip(sizes, L.padL))
        target = self._view(ws, "x_pad", shape, dx)  # the padded input's slot: it is dead by now
        target.fill(0)
        lead = (slice(None),) * (2 + f)
        if flat:
            self._col2im_flat(ws, col, target)
        else:
            self._col2im_slices(col, target)
        xp.copyto(dx, xp.moveaxis(target[lead + tuple(slice(p, p + i) for i, p in zip(sizes, L.padL))], 0, 1))
        return dx

    def _col2im_into(self, col: Any, target: Any) -> None:
        """:meth:`_col2im` for unit strides along the lowered axes, straight into ``target`` — ``dx`` seen as
        (C, n, *in) — without a padded buffer: each kernel offset's block, cut to the cells inside the image,
        is added in place, the first offset reaching the image assigning its block (and zeroing the cells it
        misses) instead of adding to zeros — the same sums in the same order, two passes fewer (a fill and
        the final transposing copy; CaffeNet's conv2, 4 images: 0.75 -> 0.57 ms)."""
        g, L = self._geom(), self._lay()
        f = L.f
        lead = (slice(None),) * (2 + f)
        first = True
        for off in itertools.product(*(range(k) for k in L.kL)):
            src, dst = [], []
            for o, d, p, m, i in zip(off, g.dilation[f:], L.padL, L.outL, g.in_shape[f:]):
                shift = o * d - p  # output cell j reads input cell j + shift
                j0, j1 = max(0, -shift), min(m, i - shift)
                src.append(slice(j0, j1))
                dst.append(slice(j0 + shift, j1 + shift))
            if any(s.stop <= s.start for s in src):
                continue  # this offset reads padding only
            block = col[(slice(None),) + off][lead + tuple(src)]
            if not first:
                target[lead + tuple(dst)] += block
                continue
            first = False
            get_array_module(target).copyto(target[lead + tuple(dst)], block)
            for a, (s, i) in enumerate(zip(dst, g.in_shape[f:])):  # the cells this offset does not reach
                rest = (slice(None),) * (len(dst) - a - 1)
                if s.start > 0:
                    target[lead + (slice(None),) * a + (slice(0, s.start),) + rest] = 0
                if s.stop < i:
                    target[lead + (slice(None),) * a + (slice(s.stop, None),) + rest] = 0
        if first:
            target.fill(0)

    def _col2im_slices(self, col: Any, target: Any) -> None:
        """``target`` (C, n, *in_F, *padded L) += every kernel offset's col block, one strided slice each."""
        g, L = self._geom(), self._lay()
        f = L.f
        lead = (slice(None),) * (2 + f)
        for off in itertools.product(*(range(k) for k in L.kL)):
            cells = tuple(slice(o * d, o * d + s * (m - 1) + 1, s)
                          for o, d, s, m in zip(off, g.dilation[f:], g.stride[f:], L.outL))
            target[lead + cells] += col[(slice(None),) + off]

    def _col2im_flat(self, ws: dict[str, Any], col: Any, target: Any) -> None:
        """:meth:`_col2im_slices` for stride and dilation 1 on narrow images, where every slice row is a few
        cells long: ``col`` is first laid out with the padded image's row strides (zeros between rows), so that
        each kernel offset becomes one shift of a contiguous run per (channel, image) — the same additions in
        the same order, each cell gaining exact zeros besides."""
        L = self._lay()
        padded = target.shape[2 + L.f:]
        plane, lead = math.prod(padded), math.prod(target.shape[1:2 + L.f])
        mult = [math.prod(padded[a + 1:]) for a in range(len(padded))]
        span = sum((o - 1) * m for o, m in zip(L.outL, mult)) + 1
        kernel = math.prod(L.kL)
        spread = self._view(ws, "col_flat", (L.C, kernel, lead, plane), col)
        spread.fill(0)
        spread.reshape((L.C, kernel, lead) + padded)[(Ellipsis,) + tuple(slice(0, o) for o in L.outL)] = \
            col.reshape((L.C, kernel, lead) + L.outL)
        flat = target.reshape(L.C, lead, plane)
        for j, off in enumerate(itertools.product(*(range(k) for k in L.kL))):
            shift = sum(k * m for k, m in zip(off, mult))
            flat[:, :, shift:shift + span] += spread[:, j, :, :span]

    def _lift(self, z: Any, yt: Any) -> None:
        """``yt`` (G, Og, n, *out) = Σ_{k_F} shifted slices of ``z`` (G, KF, Og, n, *in_F, *out_L) (with images
        last: (G, Og, *out, n) and (G, KF, Og, *in_F, *out_L, n))."""
        L = self._lay()
        lead = (slice(None),) * (2 if L.images_last else 3)
        plan = L.lift
        if not plan or not plan[0][3]:
            yt.fill(0)
        for j, (flat, dst, src) in enumerate((e[0], e[1], e[2]) for e in plan):
            s = z[(slice(None), flat) + lead[1:] + src]
            if j == 0 and plan[0][3]:
                get_array_module(yt).copyto(yt, s)
            else:
                yt[lead + dst] += s

    def _unlift(self, dyt: Any, dz: Any) -> None:
        """Adjoint of :meth:`_lift`: ``dz[:, k_F]`` = ``dyt`` shifted into input rows, zero elsewhere."""
        L = self._lay()
        g = self._geom()
        lead = (slice(None),) * (2 if L.images_last else 3)  # (G, Og, n) before the F axes of a dz[:, k_F] view
        written = {e[0]: e for e in L.lift}
        for flat in range(L.KF):
            view = dz[:, flat]
            e = written.get(flat)
            if e is None:
                view.fill(0)
                continue
            _, dst, src, _ = e
            for a, sl in enumerate(src):  # zero the rows this offset does not reach, axis by axis
                idx = [slice(None)] * view.ndim
                if sl.start > 0:
                    idx[len(lead) + a] = slice(0, sl.start)
                    view[tuple(idx)] = 0
                if sl.stop < g.in_shape[a]:
                    idx[len(lead) + a] = slice(sl.stop, None)
                    view[tuple(idx)] = 0
            view[lead + src] = dyt[lead + dst]

    # ---- per chunk bodies ----------------------------------------------------------------------
    def _forward_chunk(self, ws: dict[str, Any], x: Any, wm: Any, b: Any | None, y: Any,
                       keep: tuple[int, int] | None = None, panels: bool = False, rectify: bool = False) -> None:
        """One chunk's forward; ``keep``: the chunk's image range, under which its lowered matrix — lowered
        straight into the kept buffer, not copied there — and a copy of its input are kept for
        :meth:`_kept_lowered`; ``panels``: the products by the compiled panel GEMMs (:meth:`_panel_forward`; one
        group of 2-D images lowered span by span into their panels, no lowered matrix); ``rectify``: then ``y =
        max(y, 0)`` (:meth:`forward_rectified`), in the pass that writes ``y`` where there is one of cct's own (the
        panel tiles, the compiled move into images first, an image's bias), else over the chunk's ``y`` while it is
        in the cache."""
        L = self._lay()
        if panels and keep is None and L.G == 1 and self._geom().num_spatial_axes == 2:
            compiled = native.kernels_for(x, y, *(() if b is None else (b,)))  # contiguous float32 arrays
            if compiled is not None and self._panel_conv_forward(compiled, x, wm[0], b, y, rectify):
                return
        out = None
        if keep is not None:
            xp = get_array_module(x)
            kept = self._kept.get(keep)
            if kept is None or kept[0] is not L or kept[1].shape != x.shape or kept[1].dtype != x.dtype \
                    or get_array_module(kept[1]) is not xp:
                kept = self._kept[keep] = (L, xp.empty_like(x), xp.empty(self._lowered_shape(x.shape[0]), x.dtype))
            xp.copyto(kept[1], x)
            out = kept[2]
        col = self._lower(ws, x, out).reshape(L.G, L.K, x.shape[0] * L.cols)
        if not self._forward_lowered(ws, col, wm, b, y, panels, rectify) and rectify:
            relu_into(y, y)

    def _panel_conv_forward(self, compiled: Any, x: Any, w: Any, b: Any | None, y: Any, rectify: bool = False) -> bool:
        """``compiled.panel_conv_forward`` on a chunk's images (``rectify``: its tiles store ``max(y, 0)``); outside
        the batch partitions (a batch of fewer images than partitions would need: inference of one image) each
        image's output cells split over the cores in runs of whole tiles (each cell the same sum whichever run it is
        in).  False where the kernel declined."""
        geometry, cols, width = self._lowering_geometry(x.shape[0]), self._lay().cols, compiled.PANEL_COLS
        if in_partition():  # a chunk of a partition: one call, no split asked for
            return bool(compiled.panel_conv_forward(x, w, b, y, geometry, 0, -1, rectify))
        tiles = -(-cols // width)
        done: list[bool] = []
        run_batch(tiles, lambda _p, t0, t1: done.append(bool(compiled.panel_conv_forward(
            x, w, b, y, geometry, t0 * width, min(t1 * width, cols), rectify))),
            parts=partitions_for_flops(tiles, 2.0 * w.size * width * x.shape[0]))
        assert all(done) or not any(done), "the panel kernel declines a layer whole"
        return all(done)

    def _direct_forward(self, y: Any) -> bool:
        """Whether forward runs one GEMM per image (and group) straight into ``y``: type 1 with big images."""
        L = self._lay()
        return (L.f == 0 and not L.images_last and isinstance(y, np.ndarray) and L.cols >= DIRECT_MIN_COLS
                and y.flags.c_contiguous)

    def _panel_forward(self, y: Any, keep: bool, chunks: list[list[tuple[int, int]]]) -> bool:
        """Whether forward's type-1 products of big images run on the compiled panel GEMMs (:mod:`cct.native`,
        float32, AVX-512F or AVX2 with FMA) rather than BLAS's per-image GEMM: on one group of 2-D images
        ``panel_conv_forward``, which lowers each image span by span straight into the panels (no lowered matrix
        written out and read back), elsewhere ``panel_gemm`` on each image's lowered matrix.  Measured once per
        geometry and machine (both ways, the engine's own chunk forward on stand-ins in every batch partition at
        once: :func:`cct.engines.measured.measured_choice`), since the tiles win on few output channels, a moderate
        lowered height and many output cells — CaffeNet's conv1, 96 x 363 by 363 x 3025 — and lose elsewhere (a 256
        x 1152 by 1152 x 169 product: 1.3x BLAS's time).  Not where forward keeps its lowered matrix (small
        layers), nor for chunks of images whose products have under ``PANEL_MIN_FLOPS``."""
        g, L = self._geom(), self._lay()
        compiled = native.kernels()
        if keep or compiled is None or y.dtype != np.float32 or not self._direct_forward(y):
            return False
        images = max(n1 - n0 for c in chunks for n0, n1 in c)
        if 2.0 * L.Og * L.K * L.cols * images < PANEL_MIN_FLOPS:
            return False

        def ways(parts: int, rng: Any, stand_in: Any) -> dict[str, Any]:
            wm = self._weight_matrix(stand_in(rng, (L.O, L.Cg) + g.kernel, np.float32))
            xs = [stand_in(rng, (images, L.C) + g.in_shape, np.float32) for _ in range(parts)]
            ys = [np.empty((images, L.O) + g.out_shape, np.float32) for _ in range(parts)]
            spaces: list[dict[str, Any]] = [{} for _ in range(parts)]
            reps = range(PANEL_MEASURE_PRODUCTS)
            return {name: lambda p, panels=panels: lambda: [
                self._forward_chunk(spaces[p], xs[p], wm, None, ys[p], None, panels) for _ in reps]
                for name, panels in (("blas", False), ("panels", True))}
        return self._panel_choice(f"panel-fwd-{_geometry_key(g)}-n{images}", len(chunks), ways)

    def _panel_choice(self, key: str, parts: int, ways: Any) -> bool:
        """Whether the panel GEMMs run for ``key``: no without them (:func:`cct.native.panel_gemms`); else
        ``measured_choice`` between the ``"blas"`` and ``"panels"`` ways that ``ways(parts, rng, stand_in)`` makes
        (per batch partition: ``way(p)`` gives partition p's callable), run in every partition at once; kept per
        engine."""
        choice = self._layouts.get(key)
        if choice is None:
            if not native.panel_gemms():  # neither AVX-512F nor AVX2 with FMA here
                choice = "blas"
            else:
                from cct.engines.measured import _concurrent, measured_choice, stand_in

                made = ways(parts, np.random.default_rng(0), stand_in)
                choice = measured_choice("panel_gemm", key, {name: _concurrent(parts, way)
                                                              for name, way in made.items()})
            self._layouts[key] = choice
        return choice == "panels"

    def _panel_weight_grad(self, dy: Any, chunks: list[list[tuple[int, int]]]) -> bool:
        """Whether backward's weight gradient runs on the compiled kernel that lowers each image span by span straight
        into the panel GEMM's panels and adds the tiles' sums into the accumulator (``panel_weight_grad``: float32,
        AVX-512F or AVX2 with FMA; type 1, images first, one group, 2-D, no column dilation) rather than lowering each
        chunk for BLAS: measured once per geometry and machine (both ways, lowering included, on stand-in chunks in
        every batch partition at once: :func:`cct.engines.measured.measured_choice`).  It wins where OpenBLAS's GEMM
        with a short dimension runs well below its rate — CaffeNet's conv1, 96 outputs by 363 lowered rows — and the
        lowered matrix would leave the caches."""
        g, L = self._geom(), self._lay()
        compiled = native.kernels()
        if compiled is None or not isinstance(dy, np.ndarray) or dy.dtype != np.float32 or L.f != 0 \
                or L.images_last or L.pointwise or L.G != 1 or g.num_spatial_axes != 2 or g.dilation[1] != 1 \
                or not dy.flags.c_contiguous:
            return False
        images = max(n1 - n0 for c in chunks for n0, n1 in c)
        if 2.0 * L.M * L.K * L.cols * images < PANEL_MIN_FLOPS:
            return False

        def ways(parts: int, rng: Any, stand_in: Any) -> dict[str, Any]:
            xs = [stand_in(rng, (images, L.C) + g.in_shape, np.float32) for _ in range(parts)]
            dys = [stand_in(rng, (images, L.O) + g.out_shape, np.float32) for _ in range(parts)]
            spaces: list[dict[str, Any]] = [{} for _ in range(parts)]
            by_rows = self._weight_grad_layout(images, np.float32, parts, np) == "mxk"
            accs = [np.zeros((L.G, L.M, L.K) if by_rows else (L.G, L.K, L.M), np.float32) for _ in range(parts)]
            into = [np.zeros((L.M, L.K), np.float32) for _ in range(parts)]
            geometry = self._lowering_geometry(images)

            def blas(p: int) -> Any:
                ws = spaces[p]
                return lambda: self._weight_grad_chunk(ws, xs[p], self._unlifted(ws, self._grad_yt(ws, dys[p]), images),
                                                       accs[p], True, None, by_rows)
            return {"blas": blas,
                    "panels": lambda p: lambda: compiled.panel_weight_grad(xs[p], dys[p], into[p], geometry)}
        return self._panel_choice(f"panel-wgrad-{_geometry_key(g)}-n{images}", len(chunks), ways)

    def _kept_lowered(self, key: tuple[int, int], x: Any) -> Any | None:
        """The lowered matrix forward kept for images ``key`` if ``x`` is bitwise what it lowered, else None."""
        kept = self._kept.get(key)
        if kept is None or kept[0] is not self._lay() or kept[1].shape != x.shape or kept[1].dtype != x.dtype:
            return None
        xp = get_array_module(x)
        if get_array_module(kept[1]) is not xp:
            return None
        bits = f"u{x.dtype.itemsize}"
        if not bool(xp.array_equal(kept[1].view(bits), x.view(bits))):
            return None
        L = kept[0]
        return kept[2].reshape(L.G, L.K, x.shape[0] * L.cols)

    def _forward_lowered(self, ws: dict[str, Any], col: Any, wm: Any, b: Any | None, y: Any,
                         panels: bool = False, rectify: bool = False) -> bool:
        """``y`` (n, O, *out) from the lowered ``col`` (G, K, n·cols): GEMM, lift, transpose (+ bias);
        ``panels``: the per-image products of big type-1 images by the compiled panel GEMM.  ``rectify``: ``y =
        max(y, 0)`` where a pass of this writes ``y`` (returns True), else left to the caller (False)."""
        g, L = self._geom(), self._lay()
        xp = get_array_module(y)
        n = y.shape[0]
        if self._direct_forward(y):
            # type 1 with big images: one GEMM per image straight into y (no GEMM buffer, no transposition), its
            # bias added while the image's output is in the cache (CaffeNet's conv1 forward 63.7 -> 56.4 ms)
            col4 = col.reshape(L.G, L.K, n, L.cols)
            yv = y.reshape(n, L.G, L.Og, L.cols)
            compiled = native.kernels() if panels else None
            if compiled is not None:  # the bias added (and the value rectified) as each tile is stored
                gb = [None if b is None else b[gi * L.Og:(gi + 1) * L.Og] for gi in range(L.G)]
                if all(compiled.panel_gemm(yv[i, gi], wm[gi], col4[gi, :, i], gb[gi], rectify)
                       for i in range(n) for gi in range(L.G)):
                    return rectify
            bias = None if b is None else b.reshape((L.O,) + (1,) * g.num_spatial_axes)
            for i in range(n):
                for gi in range(L.G):
                    np.matmul(wm[gi], col4[gi, :, i], out=yv[i, gi])
                if bias is not None:
                    y[i] += bias
                if rectify:
                    relu_into(y[i], y[i])
            return rectify
        if _lifts_per_image(L, g, y.dtype, xp) and y.flags.c_contiguous:
            self._forward_lifting_gemms(col, wm, b, y)
            return False
        if self._lifts_by_gemms(y.dtype, xp):
            yt = self._view(ws, "yT", L.yt_shape(n, g.out_shape), y).reshape(L.G, L.Og, -1)
            self._lift_by_gemms(col, wm, [(gi, 0, yt[gi]) for gi in range(L.G)], math.prod(L.outL) * n, assign=True)
            images_first_copy(y, yt.reshape((L.O,) + g.out_shape + (n,)), b, rectify)
            return rectify
        z = self._view(ws, "z", (L.G, L.M, n * L.cols), y)
        for gi in range(L.G):
            xp.matmul(wm[gi], col[gi], out=z[gi])
        if L.f:
            yt = self._view(ws, "yT", L.yt_shape(n, g.out_shape), y)
            self._lift(z.reshape(L.z_shape(n)), yt)
        else:
            yt = z
        if L.images_last:
            images_first_copy(y, yt.reshape((L.O,) + g.out_shape + (n,)), b, rectify)
            return rectify
        src = xp.moveaxis(yt.reshape((L.O, n) + g.out_shape), 0, 1)
        if b is None:
            xp.copyto(y, src)
        else:
            xp.add(src, b.reshape((1, L.O) + (1,) * g.num_spatial_axes), out=y)
        return False

    # ---- pointwise (1x1 kernel, no padding): nothing to lower but a stride's subsample ------------------------
    # Image by image the GEMMs read and write the arrays where they lie; ``batched`` (where measured faster:
    # _pointwise_per_image) one GEMM covers a chunk's images, through channel-first copies.
    def _pointwise_input(self, ws: dict[str, Any], x: Any) -> Any:
        """What the pointwise GEMMs read: ``x`` itself, or with a stride its subsample (the cells the outputs read,
        (n, C, *out)) copied into the workspace — one strided copy (ResNet-50's res4a_branch2a, 10 images: 0.4 ms,
        where the compiled lowering's stride phases took 1.7)."""
        g, L = self._geom(), self._lay()
        if not L.subsampled:
            return x
        buf = self._view(ws, "x_pad", (x.shape[0], L.C) + g.out_shape, x)
        get_array_module(x).copyto(buf, x[self._subsample()])
        return buf

    def _subsample(self) -> tuple[slice, ...]:
        """The input cells a strided pointwise layer reads, as an index of (n, C, *in)."""
        return (slice(None), slice(None)) + tuple(slice(None, None, s) for s in self._geom().stride)

    def _input_channels_first(self, ws: dict[str, Any], x: Any) -> Any:
        """The cells ``x`` (n, C, *in) gives the pointwise GEMMs (its stride's subsample) copied channel-first into
        the "col" slot as (G, K, n·cols) — what :meth:`_lower` makes of a 1x1 kernel, by one plain strided copy
        (the compiled lowering's setup cost more on these small layers).  The output gradient's counterpart is
        :meth:`_grad_yt`."""
        g, L = self._geom(), self._lay()
        n, xp = x.shape[0], get_array_module(x)
        buf = self._view(ws, "col", (L.G, L.K, n * L.cols), x)
        xp.copyto(buf.reshape((L.C, n) + g.out_shape), xp.moveaxis(x[self._subsample()] if L.subsampled else x, 0, 1))
        return buf

    def _pointwise_forward(self, ws: dict[str, Any], x: Any, wm: Any, b: Any | None, y: Any,
                           batched: bool = False) -> None:
        """``y`` (n, O, *out) = ``W_m[g] · x[i, g]`` for every image ``i`` and group ``g``, read and written where
        they lie (one stacked GEMM call; ``y`` C-contiguous; a stride's subsample first), then the bias: no lowered
        copy of the input and no GEMM buffer to transpose from (GoogLeNet's 37 pointwise layers, 10 images, 2
        cores: forward 1.3-4.2x, median 2.1x faster; with the gradients below, their forward + weight gradient 106
        -> 61 ms, Caffe's 58-68 ms).  ``batched``: one GEMM per group over the images' channel-first copy, its
        result moved into ``y`` with the bias."""
        L = self._lay()
        n, xp = x.shape[0], get_array_module(y)
        if batched:
            yt = self._view(ws, "z", (L.G, L.Og, n * L.cols), y)
            xp.matmul(wm, self._input_channels_first(ws, x), out=yt)
            moved = xp.moveaxis(yt.reshape(L.O, n, L.cols), 1, 0)
            out = y.reshape(n, L.O, L.cols)
            if b is None:
                xp.copyto(out, moved)
            else:
                xp.add(moved, b.reshape(1, L.O, 1), out=out)
            return
        x = self._pointwise_input(ws, x)
        xp.matmul(wm, x.reshape(n, L.G, L.K, L.cols), out=y.reshape(n, L.G, L.Og, L.cols))
        if b is not None:
            xp.add(y, b.reshape((1, L.O) + (1,) * (y.ndim - 2)), out=y)

    def _pointwise_weight_grad(self, ws: dict[str, Any], x: Any, dy: Any, acc: Any, first: bool,
                               by_rows: bool, batched: bool = False) -> Any | None:
        """``acc`` (:meth:`_weight_grad_chunk`'s) ``+= dy[i, g] · x[i, g]ᵀ`` summed over the images, on the host
        one accumulating GEMM per image and group on the arrays where they lie (``first``: the first assigns);
        elsewhere (one call per image would be one launch each) by the channel-first copies and one GEMM, as
        ``batched`` does — which returns its channel-first ``dy`` (:meth:`_grad_yt`) for the data gradient."""
        L = self._lay()
        n = x.shape[0]
        if get_array_module(x) is not np and not batched:
            self._weight_grad_chunk(ws, x, self._grad_z(ws, dy), acc, first, None, by_rows)
            return None
        if batched:
            dyt = self._grad_yt(ws, dy).reshape(L.G, L.Og, n * L.cols)
            self._weight_grad_chunk(ws, x, dyt, acc, first, self._input_channels_first(ws, x), by_rows)
            return dyt
        xv, dyv = self._pointwise_input(ws, x).reshape(n, L.G, L.K, L.cols), dy.reshape(n, L.G, L.Og, L.cols)
        for i in range(n):
            for gi in range(L.G):
                a, b = (dyv[i, gi], xv[i, gi].T) if by_rows else (xv[i, gi], dyv[i, gi].T)
                if first and i == 0:
                    np.matmul(a, b, out=acc[gi])
                else:
                    matmul_accumulate(acc[gi], a, b)
        return None

    def _pointwise_data_grad(self, ws: dict[str, Any], wm: Any, dy: Any, dx: Any, batched: bool = False,
                             dyt: Any | None = None) -> None:
        """``dx[i, g] = W_m[g]ᵀ · dy[i, g]`` for every image and group, straight into ``dx`` (C-contiguous) — with a
        stride into a buffer whose values then go to the subsampled cells, zeros elsewhere: the adjoint of
        :meth:`_pointwise_forward`, no col2im.  ``batched``: one GEMM per group over the channel-first ``dyt``
        (made here when not given), its result moved into ``dx``."""
        g, L = self._geom(), self._lay()
        n, xp = dy.shape[0], get_array_module(dy)
        if batched:
            dyt = self._grad_yt(ws, dy).reshape(L.G, L.Og, n * L.cols) if dyt is None else dyt
            dxt = self._view(ws, "col", (L.G, L.K, n * L.cols), dy)
            xp.matmul(wm.transpose(0, 2, 1), dyt, out=dxt)
            if L.subsampled:
                dx.fill(0)
            xp.copyto(dx[self._subsample()] if L.subsampled else dx,
                      xp.moveaxis(dxt.reshape((L.C, n) + g.out_shape), 1, 0))
            return
        out = self._view(ws, "col", (n, L.C) + g.out_shape, dy) if L.subsampled else dx
        xp.matmul(wm.transpose(0, 2, 1), dy.reshape(n, L.G, L.Og, L.cols), out=out.reshape(n, L.G, L.K, L.cols))
        if L.subsampled:
            dx.fill(0)
            dx[self._subsample()] = out

    # ---- type 2 with the images innermost: the lifting sums done by the GEMMs ----------------------------
    def _lifts_by_gemms(self, dtype: Any, xp: Any) -> bool:
        """Whether type 2 with the images innermost runs its lifted kernel offsets as GEMMs over whole row
        blocks (host arrays whose BLAS adds in place): a row of the lifted axis is a contiguous run of columns
        (the lowered axes' output cells times the chunk's images) in the lowered matrix, the output and its
        gradient alike, so each offset's rows of every image form one column range — one GEMM per group and
        offset, adding (beta = 1) into the rows it reaches, instead of a GEMM into a buffer of every offset's
        products and a pass summing them (and, backward, a pass spreading the gradient into that buffer).  The
        offsets' products over rows they cannot reach (the input rows beyond the output's) are not computed."""
        L = self._lay()
        return L.images_last and L.f == 1 and xp is np and accumulates_in_place(dtype)

    def _lift_by_gemms(self, col: Any, wm: Any, blocks: list[tuple[int, int, Any]], plane: int, assign: bool) -> None:
        """Type 2's lifting sums done by the GEMMs: for each block ``(group, c0, out)`` and lifted kernel offset,
        ``out[:, the output rows it reaches] += W_m[group, offset] · col[group][:, c0 + the input rows it reads]``
        (rows of ``plane`` columns; a block is one image with the images first, the chunk with them innermost);
        with ``assign`` an offset reaching every output row goes first and assigns, else ``out`` is zeroed."""
        L = self._lay()
        plan = L.lift
        full = assign and bool(plan) and plan[0][3]
        for gi, c0, out in blocks:
            if assign and not full:
                out.fill(0)
            for j, (flat, dst, src, _) in enumerate(plan):
                a = wm[gi, flat * L.Og:(flat + 1) * L.Og]
                b = col[gi][:, c0 + src[0].start * plane:c0 + src[0].stop * plane]
                if j == 0 and full:
                    np.matmul(a, b, out=out)
                else:
                    matmul_accumulate(out[:, dst[0].start * plane:dst[0].stop * plane], a, b)

    def _weight_grad_by_rows(self, ws: dict[str, Any], x: Any, dyt: Any, acc: Any, first: bool,
                             col: Any | None, by_rows: bool) -> None:
        """:meth:`_weight_grad_chunk` from the channel-first gradient ``dyt`` itself: per group and lifted offset
        ``dW_m[g, offset] += dyt[g, its output rows] · col[g, the input rows they read]ᵀ`` (in ``acc``'s layout)."""
        L = self._lay()
        n = x.shape[0]
        plane = math.prod(L.outL) * n
        if col is None:
            col = self._lower(ws, x).reshape(L.G, L.K, n * L.cols)
        dy2 = dyt.reshape(L.G, L.Og, -1)
        if first:
            acc.fill(0)
        for gi in range(L.G):
            for flat, dst, src, _ in L.lift:
                d = dy2[gi][:, dst[0].start * plane:dst[0].stop * plane]
                c = col[gi][:, src[0].start * plane:src[0].stop * plane]
                rows = slice(flat * L.Og, (flat + 1) * L.Og)
                if by_rows:
                    matmul_accumulate(acc[gi, rows], d, c.T)
                else:
                    matmul_accumulate(acc[gi][:, rows], c, d.T)

    def _data_grad_by_rows(self, wm: Any, dyt: Any, dcol: Any, n: int) -> None:
        """``dcol`` (G, K, n·cols) = Σ over lifted offsets of ``W_m[g, offset]ᵀ · dyt[g, its output rows]`` into the
        input rows they read (type 2; ``dyt`` channel-first, ``(G·Og, n·out)``): with the images innermost one GEMM
        per group and offset over the whole chunk, else one per image too (the rows of one image are a column
        range).  The offset that reads every input row, if one does, assigns (else zeros first)."""
        L = self._lay()
        plane = math.prod(L.outL)
        if L.images_last:  # one block: the chunk's images are inside every row
            plane, blocks = plane * n, [(0, 0)]
        else:
            blocks = [(i * L.cols, i * math.prod(L.outF) * plane) for i in range(n)]
        dy2 = dyt.reshape(L.G, L.Og, -1)
        rows = L.inF[0]
        plan = sorted(L.lift, key=lambda e: (e[2][0].start, -e[2][0].stop))  # one reading every row first
        covers = bool(plan) and plan[0][2][0].start == 0 and plan[0][2][0].stop == rows
        if not covers:
            dcol.fill(0)
        span = rows * plane  # one block's columns of dcol
        for gi in range(L.G):
            for j, (flat, dst, src, _) in enumerate(plan):
                a = wm[gi, flat * L.Og:(flat + 1) * L.Og].T
                for c0, y0 in blocks:
                    b = dy2[gi][:, y0 + dst[0].start * plane:y0 + dst[0].stop * plane]
                    if j == 0 and covers:
                        np.matmul(a, b, out=dcol[gi][:, c0:c0 + span])
                    else:
                        matmul_accumulate(dcol[gi][:, c0 + src[0].start * plane:c0 + src[0].stop * plane], a, b)

    def _forward_lifting_gemms(self, col: Any, wm: Any, b: Any | None, y: Any) -> None:
        """Type 2 forward (``FUSED_LIFT_MIN_COLS``): ``y`` (n, O, *out) = bias, then per image and group the lifted
        kernel offsets' GEMMs added into its rows (:meth:`_lift_by_gemms`)."""
        g, L = self._geom(), self._lay()
        n = y.shape[0]
        if b is None:
            y.fill(0)
        else:
            np.copyto(y, b.reshape((1, L.O) + (1,) * g.num_spatial_axes))
        out = y.reshape(n, L.G, L.Og, -1)
        self._lift_by_gemms(col, wm, [(gi, i * L.cols, out[i, gi]) for i in range(n) for gi in range(L.G)],
                            math.prod(L.outL), assign=False)

    def _grad_z(self, ws: dict[str, Any], dy: Any) -> Any:
        """dZ (G, KF·Og, n·cols): ``dy`` channel-first (in the "z" slot for type 1, else "yT"), unlifted
        along F into the "z" slot."""
        return self._unlifted(ws, self._grad_yt(ws, dy), dy.shape[0])

    def _unlifted(self, ws: dict[str, Any], dyt: Any, n: int) -> Any:
        """dZ (G, KF·Og, n·cols) from the channel-first gradient ``dyt`` of ``n`` images (itself for type 1)."""
        g, L = self._geom(), self._lay()
        if not L.f:
            return dyt.reshape(L.G, L.M, n * L.cols)
        dz = self._view(ws, "z", L.z_shape(n), dyt)
        self._unlift(dyt.reshape(L.yt_shape(n, g.out_shape)), dz)
        return dz.reshape(L.G, L.M, n * L.cols)

    def _grad_yt(self, ws: dict[str, Any], dy: Any) -> Any:
        """``dy`` channel-first (O, n, *out) — with images last (O, *out, n) — in the "z" slot for type 1, else
        "yT" — or, for one image first, ``dy`` itself seen so (it is channel-first already: no copy; CaffeNet's
        conv1, lowered an image at a time, backward 4% faster)."""
        g, L = self._geom(), self._lay()
        xp = get_array_module(dy)
        if not L.images_last and dy.shape[0] == 1 and dy.flags.c_contiguous:
            return xp.moveaxis(dy, 1, 0)
        dyt = self._view(ws, "yT" if L.f else "z", (L.O,) + L.yt_shape(dy.shape[0], g.out_shape)[2:], dy)
        compiled = native.kernels_for(dy, dyt) if L.images_last and dy.shape[0] else None
        if compiled is not None:  # (n, O·cells) -> (O·cells, n), tiled
            compiled.transpose(dy, dyt, dy.shape[0], dy.size // dy.shape[0], None, 1)
        else:
            xp.copyto(dyt, xp.moveaxis(dy, 0, -1) if L.images_last else xp.moveaxis(dy, 1, 0))
        return dyt

    def _weight_grad_chunk(self, ws: dict[str, Any], x: Any, dz: Any, acc: Any, first: bool,
                           col: Any | None = None, by_rows: bool = False) -> Any:
        """``acc += dZ · colᵀ``: (G, K, M) by the GEMM ``col · dZᵀ``, or with ``by_rows`` (G, M, K) by
        ``dZ · colᵀ`` (:meth:`_weight_grad_layout`); ``first``: assign.  Returns the lowered ``col`` matrix."""
        L = self._lay()
        xp = get_array_module(x)
        n = x.shape[0]
        if col is None:
            col = self._lower(ws, x).reshape(L.G, L.K, n * L.cols)
        for gi in range(L.G):
            a, b = (dz[gi], col[gi].T) if by_rows else (col[gi], dz[gi].T)
            if first:
                xp.matmul(a, b, out=acc[gi])
            else:  # BLAS adds into the accumulator: no product buffer and no pass adding it (1-2% of backward)
                matmul_accumulate(acc[gi], a, b)
        return col

    def _weight_grad_layout(self, images: int, dtype: Any, parts: int, xp: Any) -> str:
        """``"kxm"`` (the GEMM ``col · dZᵀ``) or ``"mxk"`` (``dZ · colᵀ``) for the weight gradient of chunks of
        ``images``: the same sums, as fast as each other with AVX2 OpenBLAS kernels; with AVX-512 ones
        ``dZ · colᵀ`` is 8% faster on CaffeNet's conv2 (K 240, M 640, 2916 columns) and 14% slower on conv1
        (K 363, M 96, 9075 columns), so it is measured once per shape and machine
        (:func:`cct.engines.measured.measured_choice`) on stand-in operands, in every partition at once, as
        the layer runs.  Small GEMMs and other array modules keep ``"kxm"``."""
        L = self._lay()
        columns = images * L.cols
        if 2.0 * L.K * L.M * columns < WEIGHT_LAYOUT_MIN_FLOPS or xp is not np:
            return "kxm"
        key = f"wgrad-k{L.K}-m{L.M}-n{columns}-{np.dtype(dtype).name}-p{parts}"
        layout = self._layouts.get(key)
        if layout is not None:
            return layout
        from cct.engines.measured import _concurrent, measured_choice, stand_in

        rng = np.random.default_rng(0)
        col = [stand_in(rng, (L.K, columns), dtype) for _ in range(parts)]
        dz = [stand_in(rng, (L.M, columns), dtype) for _ in range(parts)]
        outs = [[np.empty((L.K, L.M), dtype), np.empty((L.M, L.K), dtype)] for _ in range(parts)]
        ways = {"kxm": _concurrent(parts, lambda p: lambda: np.matmul(col[p], dz[p].T, out=outs[p][0])),
                "mxk": _concurrent(parts, lambda p: lambda: np.matmul(dz[p], col[p].T, out=outs[p][1]))}
        layout = self._layouts[key] = measured_choice("gemm_orientation", key, ways)
        return layout

    def _pointwise_per_image(self, chunks: list[list[tuple[int, int]]], dtype: Any, direction: str, xp: Any) -> bool:
        """Whether a pointwise layer's ``direction`` (``"forward"``, ``"backward"``: both gradients, ``"weights"``)
        runs its GEMMs image by image on the arrays where they lie, else ``batched`` over each chunk's images
        through channel-first copies (a pass over the input and the output each).  Measured once per shape,
        direction and machine (:func:`cct.engines.measured.measured_choice`: the two ways of this engine's own
        methods on stand-in operands, in every partition at once) below ``POINTWISE_BATCH_MAX_COLS`` output cells;
        image by image elsewhere, on other array modules and for GEMMs under ``WEIGHT_LAYOUT_MIN_FLOPS`` a
        chunk."""
        L = self._lay()
        images, parts = max(n1 - n0 for c in chunks for n0, n1 in c), len(chunks)
        if xp is not np or L.cols >= POINTWISE_BATCH_MAX_COLS or \
                2.0 * L.K * L.M * L.cols * images < WEIGHT_LAYOUT_MIN_FLOPS:
            return True
        dtype = np.dtype(dtype)
        key = (f"pointwise-{direction}-g{L.G}-k{L.K}-m{L.M}-c{L.cols}-i{math.prod(self._geom().in_shape)}-n{images}"
               f"-{dtype.name}-p{parts}")
        way = self._layouts.get(key)
        if way is None:
            from cct.engines.measured import _concurrent, measured_choice

            self._layouts[key] = way = measured_choice("pointwise_gemms", key, {
                "images": _concurrent(parts, lambda p: self._pointwise_way(direction, images, dtype, parts, False, p)),
                "batched": _concurrent(parts, lambda p: self._pointwise_way(direction, images, dtype, parts, True, p))})
        return way == "images"

    def _pointwise_way(self, direction: str, n: int, dtype: Any, parts: int, batched: bool, seed: int) -> Any:
        """A callable running one way of :meth:`_pointwise_per_image`'s ``direction`` on ``n`` stand-in images."""
        from cct.engines.measured import stand_in

        g, L = self._geom(), self._lay()
        rng = np.random.default_rng(seed)
        x, dy = stand_in(rng, (n, L.C) + g.in_shape, dtype), stand_in(rng, (n, L.O) + g.out_shape, dtype)
        wm = stand_in(rng, (L.G, L.Og, L.K), dtype)
        ws: dict[str, Any] = {}
        if direction == "forward":
            y = np.empty_like(dy)
            return lambda: self._pointwise_forward(ws, x, wm, None, y, batched)
        by_rows = self._weight_grad_layout(n if batched else 1, dtype, parts, np) == "mxk"
        acc = np.empty((L.G, L.M, L.K) if by_rows else (L.G, L.K, L.M), dtype)
        dx = np.empty_like(x) if direction == "backward" else None

        def run() -> None:
            dyt = self._pointwise_weight_grad(ws, x, dy, acc, True, by_rows, batched)
            if dx is not None:
                self._pointwise_data_grad(ws, wm, dy, dx, batched, dyt)
        return run

    # ---- the engine interface -----------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        return self._forward(x, w, b, y, False)

    def forward_rectified(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        """:meth:`forward`, each chunk's output rectified as it is written (:meth:`_forward_chunk`)."""
        return self._forward(x, w, b, y, True)

    def _forward(self, x: Any, w: Any, b: Any | None, y: Any, rectify: bool) -> Any:
        wm = self._weight_matrix(w)
        L = self._lay()
        xp = get_array_module(x)
        chunks = self._chunks(x.shape[0], x.itemsize, xp)
        if L.pointwise and y.flags.c_contiguous:
            batched = not self._pointwise_per_image(chunks, x.dtype, "forward", xp)
            self._kept.clear()

            def pointwise(ws: dict[str, Any], part: int, n0: int, n1: int) -> None:
                self._pointwise_forward(ws, x[n0:n1], wm, b, y[n0:n1], batched)
                if rectify:
                    relu_into(y[n0:n1], y[n0:n1])
            self._run(self._space(x), chunks, pointwise)
            return y
        lowered = L.G * L.K * x.shape[0] * L.cols
        keep = self._trains and lowered * x.itemsize <= KEEP_LOWERED_MAX_BYTES and x.size <= lowered
        if not keep:
            self._kept.clear()
        panels = self._panel_forward(y, keep, chunks)
        self._run(self._space(x), chunks,
                  lambda ws, part, n0, n1: self._forward_chunk(ws, x[n0:n1], wm, b, y[n0:n1],
                                                               (n0, n1) if keep else None, panels, rectify))
        return y

    def _weight_accumulators(self, space: Workspace, dw: Any | None, chunks: list[list[tuple[int, int]]],
                             images: int | None = None, by_rows: bool | None = None) -> tuple[list[Any], bool]:
        """Per partition, where it accumulates dW_m — a workspace buffer, (G, K, M) or (G, M, K) as
        :meth:`_weight_grad_layout` has it for GEMMs over ``images`` images (default: a chunk's; ``by_rows``
        decides instead where given) — and whether it is the latter."""
        L = self._lay()
        if dw is None:
            return [], False
        if images is None:
            images = max(n1 - n0 for c in chunks for n0, n1 in c)
        if by_rows is None:
            by_rows = self._weight_grad_layout(images, dw.dtype, len(chunks), get_array_module(dw)) == "mxk"
        shape = (L.G, L.M, L.K) if by_rows else (L.G, L.K, L.M)
        return [self._view(space.part(p), "dw_acc", shape, dw) for p in range(len(chunks))], by_rows

    def _finish_weight_grad(self, dw: Any | None, accs: list[Any], by_rows: bool) -> None:
        """``dw +=`` the partitions' accumulators summed in partition order.  On the host the sum runs over input
        channel ranges in the batch partitions, each value's additions in the same order (the same bits as one
        thread's sum): on one core, 16 accumulators of CaffeNet's conv3 (3.4 MiB each) took 2.8 ms to sum."""
        if dw is None:
            return
        if get_array_module(dw) is not np:
            total = accs[0]
            for a in accs[1:]:
                total += a
            self._add_weight_grad(dw, total.transpose(0, 2, 1) if by_rows else total)
            return
        L = self._lay()
        dw5 = dw.reshape(L.G, L.Og, L.Cg, L.KF, L.KL)

        def body(_part: int, c0: int, c1: int) -> None:
            cols = slice(c0 * L.KL, c1 * L.KL)  # K = (Cg, KL): these channels' rows (columns of an M x K one)
            for gi in range(L.G):
                total = accs[0][gi][:, cols] if by_rows else accs[0][gi][cols]
                for a in accs[1:]:
                    total += a[gi][:, cols] if by_rows else a[gi][cols]
                # M = (KF, Og); dw is (G, Og, Cg, KF, KL)
                src = total.reshape(L.KF, L.Og, c1 - c0, L.KL).transpose(1, 2, 0, 3) if by_rows else \
                    total.reshape(c1 - c0, L.KL, L.KF, L.Og).transpose(3, 0, 2, 1)
                dw5[gi][:, c0:c1] += src

        run_batch(L.Cg, body, work=float(len(accs) * L.G * L.KL * L.M))

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        """Weight and data gradients sharing one unlifting of ``dy`` and one lowering buffer."""
        if dx is None and dw is None:
            return
        L = self._lay()
        xp = get_array_module(dy)
        wm = self._weight_matrix(w) if dx is not None else None
        n = dy.shape[0]
        space = self._space(dy)
        chunks = self._chunks(n, dy.itemsize, xp)
        pointwise = L.pointwise and dy.flags.c_contiguous and (dx is None or dx.flags.c_contiguous)
        batched = pointwise and not self._pointwise_per_image(chunks, dy.dtype,
                                                              "weights" if dx is None else "backward", xp)
        panels = dw is not None and self._panel_weight_grad(dy, chunks)
        accs, by_rows = self._weight_accumulators(space, dw, chunks,
                                                  1 if pointwise and not batched and xp is np else None,
                                                  True if panels else None)
        firsts = {c[0][0] for c in chunks}
        self._trains = self._trains or dw is not None
        compiled = native.kernels() if panels else None

        by_gemms = self._lifts_by_gemms(dy.dtype, xp)
        # type 2 on wide outputs (as its forward): the data gradient by one GEMM per image, group and offset too
        rows_per_image = _lifts_per_image(L, self._geom(), dy.dtype, xp)

        def body(ws: dict[str, Any], part: int, n0: int, n1: int) -> None:
            first = n0 in firsts
            if compiled is not None:  # the weight gradient lowered span by span into the compiled tiles' panels
                if first:
                    accs[part].fill(0)
                if native.takes(x[n0:n1], dy[n0:n1]) and compiled.panel_weight_grad(
                        x[n0:n1], dy[n0:n1], accs[part][0], self._lowering_geometry(n1 - n0)):
                    if dx is not None:
                        data_grad(ws, n0, n1)
                    return  # else declined, nothing computed: the GEMMs below
            if pointwise:
                dyt = None
                if dw is not None:
                    dyt = self._pointwise_weight_grad(ws, x[n0:n1], dy[n0:n1], accs[part], first, by_rows,
                                                      batched)
                if dx is not None:
                    self._pointwise_data_grad(ws, wm, dy[n0:n1], dx[n0:n1], batched, dyt)
                return
            dyt = self._grad_yt(ws, dy[n0:n1])
            if by_gemms:  # the gradient stays channel-first: its offsets' rows are column ranges of it
                if dw is not None:
                    self._weight_grad_by_rows(ws, x[n0:n1], dyt, accs[part], first,
                                              self._kept_lowered((n0, n1), x[n0:n1]), by_rows)
                if dx is not None:
                    dcol = self._view(ws, "col", (L.G, L.K, (n1 - n0) * L.cols), dy)
                    self._data_grad_by_rows(wm, dyt, dcol, n1 - n0)
                    self._col2im(ws, dcol.reshape(L.col_shape(n1 - n0)), dx[n0:n1])
                return
            dz = None if dw is None and rows_per_image else self._unlifted(ws, dyt, n1 - n0)
            if dw is not None:
                self._weight_grad_chunk(ws, x[n0:n1], dz, accs[part], first,
                                        self._kept_lowered((n0, n1), x[n0:n1]), by_rows)
            if dx is not None:
                data_grad(ws, n0, n1, dyt, dz)

        def data_grad(ws: dict[str, Any], n0: int, n1: int, dyt: Any = None, dz: Any = None) -> None:
            if dyt is None:
                dyt = self._grad_yt(ws, dy[n0:n1])
            dcol = self._view(ws, "col", (L.G, L.K, (n1 - n0) * L.cols), dy)
            if rows_per_image:
                self._data_grad_by_rows(wm, dyt, dcol, n1 - n0)
            else:
                if dz is None:
                    dz = self._unlifted(ws, dyt, n1 - n0)
                for gi in range(L.G):
                    xp.matmul(wm[gi].T, dz[gi], out=dcol[gi])
            self._col2im(ws, dcol.reshape(L.col_shape(n1 - n0)), dx[n0:n1])

        self._run(space, chunks, body)
        self._finish_weight_grad(dw, accs, by_rows)

    def forward_and_backward_weights(self, x: Any, w: Any, y: Any | None, dy: Any, dw: Any | None) -> None:
        """``y[...] = conv(x, w)`` and ``dw += corr(x, dy)``, lowering ``x`` once (Deconvolution backward)."""
        if y is None or dw is None or self._lay().pointwise:  # pointwise: nothing to lower, nothing to share
            super().forward_and_backward_weights(x, w, y, dy, dw)
            return
        L = self._lay()
        wm = self._weight_matrix(w)
        space = self._space(x)
        chunks = self._chunks(x.shape[0], x.itemsize, get_array_module(x))
        accs, by_rows = self._weight_accumulators(space, dw, chunks)
        firsts = {c[0][0] for c in chunks}

        def body(ws: dict[str, Any], part: int, n0: int, n1: int) -> None:
            dz = self._grad_z(ws, dy[n0:n1])
            col = self._lower(ws, x[n0:n1]).reshape(L.G, L.K, (n1 - n0) * L.cols)
            self._weight_grad_chunk(ws, x[n0:n1], dz, accs[part], n0 in firsts, col, by_rows)
            self._forward_lowered(ws, col, wm, None, y[n0:n1])  # z and yT slots: dz/dyT are dead now

        self._run(space, chunks, body)
        self._finish_weight_grad(dw, accs, by_rows)

    # ---- Im2col layer helpers (type-1 layout) --------------------------------------------------
    def im2col(self, x: Any, out: Any | None = None) -> Any:
        """Lower ``x`` (n, C, *in) into ``out`` (or a workspace) of shape (C, *kernel, n, *out) — type 1."""
        if self.strategy != 1:
            self.set_strategy(1, self.reason)
        return self._lower(self._space(x).part(0), x, out, images_last=False)

    def col2im(self, col: Any, dx: Any) -> Any:
        """``dx[...] = Σ`` of every column entry of ``col`` (C, *kernel, n, *out) into its input cell."""
        if self.strategy != 1:
            self.set_strategy(1, self.reason)
        return self._col2im(self._space(dx).part(0), col, dx, images_last=False)
