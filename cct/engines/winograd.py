"""Winograd minimal filtering for 3x3 convolutions (Lavin & Gray, "Fast Algorithms for Convolutional Neural
Networks", CVPR 2016), F(m x m, 3 x 3) with output tiles of m = 4 (default) or 2.

Each ``(m+2) x (m+2)`` input tile ``d`` (tiles overlap by 2 and step by ``m``) gives an ``m x m`` output tile

    Y = Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A

so a tile costs ``(m+2)²`` multiplications per (input, output) channel pair instead of ``9 m²``: 36 instead of
144 for m = 4 (4x fewer), 16 instead of 36 for m = 2 (2.25x).  Summed over input channels the element-wise
products become ``(m+2)²`` independent GEMMs, ``V[ξ] (tiles x Cg) · U[ξ]ᵀ (Cg x Og)``, which is where the time
goes.  The tiles keep the channels innermost (the input is moved to (n, H, W, C) once), so that a tile's cells are
runs of C values.  With the compiled kernels (:mod:`cct.native`: ``winograd_tiles``, ``winograd_untile``) each
tile's transforms run as the 1-D matrices down its rows and across, channels in the vector lanes, straight from
the moved input into the tile's a² rows and from the products into ``y`` (the cut to the output, the bias and an
in-place ReLU after the layer in that pass), the transformed values laid out tile by tile (the GEMMs read each
position's matrix with a row stride); CaffeNet's conv3 at 64 images on 2 AVX2 cores: forward 0.94x, data gradient
0.86x, weight gradient 0.92x the time of the numpy transforms, a 128 -> 128 layer on 56x56 0.72-0.83x.  Without
them the transforms are GEMMs with the Kronecker products ``Bᵀ⊗Bᵀ`` and ``Aᵀ⊗Aᵀ`` on gathered copies of the
whole chunk.

Scope: 2-D, 3x3 kernels, stride 1, no dilation, padding at most 2 per side, numpy arrays (the CPU), any group
count, float32 and float64.  The data gradient is the same computation on ``dy`` with the kernels flipped and
their channel axes swapped, padded ``2 - pad``.  The weight gradient is the transposed algorithm: the forward's
bilinear form ``Σ dY·Y = Σ_ξ (A dY Aᵀ)[ξ] (G g Gᵀ)[ξ] (Bᵀ d B)[ξ]`` differentiated by the kernel gives
``dW = Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G`` — the same input-tile transform, the output tiles' gradient
transformed by ``A``, the sum over tiles and images as ``(m+2)²`` GEMMs (Og x tiles)·(tiles x Cg), then one small
transform back —; where the lowering engine's weight gradient (the lowering its cost model prefers) is faster
on the machine, measured once per geometry, that runs instead.

Accuracy: the transforms' coefficients (up to 25 and 64 for m = 4) cost some float32 precision — on random
CaffeNet-sized layers the largest difference from a direct sum is ~1.5e-5 of the output's largest magnitude
for m = 4 and ~8e-7 for m = 2 (the weight gradient of CaffeNet's conv3 at 64 images: 1.8e-5 and 2.0e-6 of its
RMS, the lowering engine's float32 sums 1.4e-6), within the library's comparison rule (1e-4 of the larger of the
value and the blob's RMS) but not bitwise Caffe's order.  ``auto`` therefore takes this engine only for a clear
gain on a layer of some size — measured, or where the models decide predicted by a margin
(:mod:`cct.engines.choice`); ``-conv_engine winograd`` forces it.

The batch is split into the batch partitions (:mod:`cct.runtime.partition`) and each partition walks its
images in chunks whose buffers (padded input, tiles, transformed tiles and products, output tiles) share the
lowering engine's budget (``lowering_max_mb``, ``CCT_LOWERING_MAX_MB``: 32 MiB per layer call, split between
the partitions), but hold at least ``MIN_CHUNK_TILES`` tiles (the channel GEMMs' rows).  The weight gradient
runs the partitions' chunks together, a round of the batch at a time: the partitions transform their tiles into
one array, then the a² positions' GEMMs run over all its tiles, split over the cores, into one accumulator (on
many cores a partition's own tiles are few: the GEMMs' inner dimension would be short).  The buffers are slots
of the thread's workspace that the net's lowering engines share (:func:`cct.engines.lowering.shared_workspace`)
— the lowering engine's own slot names, the weight gradient's accumulator included, since every slot is scratch
for the duration of one call (only the output tiles' channels-innermost copy has a slot of its own) —, so the
engine adds memory only where it needs more than they do.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from cct import native
from cct.elementwise import relu_into
from cct.engines.base import ConvEngine, ConvGeometry, Estimate
from cct.engines.cost_model import DEFAULT_RATES, gemm_seconds
from cct.engines.gemm import matmul_accumulate
from cct.engines.lowering import LoweringEngine, chunk_budget_bytes, shared_workspace, workspace_view
from cct.errors import CctError
from cct.runtime.partition import batch_ranges, partitions_for, run_batch, run_partitions
from cct.runtime.threads import blas_threads

# F(m, 3): (Bᵀ, G, Aᵀ) for interpolation points 0, ±1 (m = 2) and 0, ±1, ±2 (m = 4), plus the point at infinity
_TRANSFORMS: dict[int, tuple[list[list[float]], list[list[float]], list[list[float]]]] = {
    2: ([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]]),
    4: ([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
         [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]],
        [[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6], [1 / 24, 1 / 12, 1 / 6],
         [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]],
        [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]]),
}
TILES = tuple(sorted(_TRANSFORMS))
# a chunk holds at least this many tiles (its images' tiles, whatever the budget): fewer make the (m+2)² channel
# GEMMs (tiles x Cg)·(Cg x Og) short — CaffeNet's conv3, F(4x4,3x3), on one core: 229 GFLOP/s at 1024 tiles, 211 at
# 256, 192 at 128, 172 at 80 (32 MiB shared by two partitions) with AVX-512 OpenBLAS kernels; 121, 115, 112, 107
# with AVX2 ones.  Not more: the chunk's buffers are slots of the workspace the net's convolutions share, and at
# 256 tiles conv4's F(4x4,3x3) took 56 MiB per partition (CaffeNet, conv3 on the FFT: peak RSS 1.11-1.14x
# PyTorch's; 1.03-1.06x at 128)
MIN_CHUNK_TILES = 128
# output channels per block of the weight gradient's kernel-side transform
TRANSFORM_BACK_CHANNELS = 16
# of the weight gradient's measured choice (2: tiles with the channels innermost; 3: the kernel-side transform over
# the partitions; 4: one choice per geometry whatever the batch; 5: the tiles' transforms compiled; 6: the GEMMs by
# positions over all partitions' tiles): choices measured by another version are measured again
WGRAD_MEASURE_VERSION = 6


class WinogradEngine(ConvEngine):
    """F(m x m, 3 x 3) Winograd convolution (see the module docstring); ``tile`` is m (4 or 2)."""

    name = "winograd"

    def __init__(self, tile: int = 4, workspace: Any = None) -> None:
        """``workspace``: private buffers (a :class:`~cct.engines.lowering.Workspace`: the autotune's
        candidates, whose buffers must not stay in the net's shared workspace), default the thread's shared one."""
        super().__init__()
        if tile not in _TRANSFORMS:
            raise ValueError(f"winograd tile must be one of {TILES} (got {tile!r})")
        self.tile = tile
        bt, gm, at = (np.array(t, dtype=np.float64) for t in _TRANSFORMS[tile])
        self._bb = np.kron(bt, bt)   # (a², a²): input tile -> transformed tile
        self._aa = np.kron(at, at)   # (m², a²): transformed product -> output tile
        self._gg = np.kron(gm, gm)   # (a², 9): kernel -> transformed kernel
        self.dtype: Any = np.dtype(np.float32)
        self._consts: dict[Any, tuple[Any, Any, Any]] = {}
        self._private = workspace
        self._workspace: Any = None  # the thread's workspace shared with the lowering engines, or the private one
        self._weights_engine: Any = None
        self._wgrad_method: str | None = None

    # ---- applicability and cost ---------------------------------------------------------------
    @staticmethod
    def supports(g: ConvGeometry) -> tuple[bool, str]:
        """(True, "") when the engine can compute ``g``, else (False, the reason)."""
        if g.num_spatial_axes != 2:
            return False, f"winograd runs 2-D convolutions ({g.num_spatial_axes}-D here)"
        if tuple(g.kernel) != (3, 3):
            return False, f"winograd runs 3x3 kernels ({'x'.join(map(str, g.kernel))} here)"
        if any(s != 1 for s in g.stride):
            return False, "winograd runs stride 1"
        if any(d != 1 for d in g.dilation):
            return False, "winograd runs undilated kernels"
        if any(p > 2 for p in g.pad):
            return False, "winograd runs padding up to 2"
        return True, ""

    @classmethod
    def estimates(cls, g: ConvGeometry, dtype: Any = "float32", rates: Any = None, xp: Any = None) -> list[Estimate]:
        """Per tile size: the transforms (gathers and Kronecker GEMMs) and the ``(m+2)²`` channel GEMMs of the
        forward and of the data gradient, plus the weight gradient (its ``(m+2)²`` GEMMs and transforms, or
        the lowering engine's where that is predicted faster); the workspace of one chunk per partition."""
        if (xp is not None and xp is not np) or not cls.supports(g)[0]:
            return []
        rates = rates or DEFAULT_RATES
        itemsize = np.dtype(dtype).itemsize
        # the lowering engine's weight gradient: about half of the best lowering's backward pass
        weights = min(e.backward_seconds for e in LoweringEngine.estimates(g, dtype, rates)) / 2
        out = []
        og, cg = g.out_channels // g.group, g.in_channels // g.group
        pairs = g.group * og * cg  # kernel entries over 9: (input, output) channel pairs
        parts = partitions_for(g.num, _image_work(g))
        widest = max(g.in_channels, g.out_channels)
        # the compiled kernels transform the tiles in passes over memory; without them, Kronecker GEMMs on gathered
        # copies
        compiled = native.kernels() is not None and np.dtype(dtype) in (np.float32, np.float64)
        in_cells, out_cells = g.num * math.prod(g.in_shape), g.num * g.out_count

        def passes(values: float, c_in: int, c_out: int, m: int, tiles: int) -> float:
            """The compiled transforms' passes over memory: ``values`` read or written where they lie (the input
            moved channels last, the output written), ``c_in`` channels' tiles transformed and ``c_out`` channels'
            products transformed back, ``tiles`` tiles of (m+2)² values each."""
            return (values + (m + 2) ** 2 * (c_in + c_out) * tiles) / rates.transpose_elems
        for m in TILES:
            a = m + 2
            per_tile_image = _image_tiles(g, m)
            tiles = per_tile_image * g.num
            per_image = _image_bytes(m, widest, widest, g.out_shape, itemsize)
            images = min(_ceil(g.num, parts), _chunk_images(per_tile_image, parts, per_image))
            # the channel GEMMs run chunk by chunk, a chunk's tiles their rows (or inner dimension), each partition
            # on its share of the cores: the model's whole-machine GEMM on the chunk, once per chunk of the batch
            # (a 14x14 image makes 16 tiles at m = 4: VGG16's conv5_1 at 8 images, 64 tiles per GEMM)
            chunk = per_tile_image * images
            chunks = tiles / chunk

            def one_pass(c_in: int, c_out: int, cells_in: int, cells_out: int, m: int = m, a: int = a,
                         tiles: int = tiles, chunk: int = chunk, chunks: float = chunks) -> float:
                gemms = g.group * a * a * chunks * gemm_seconds(c_out // g.group, c_in // g.group, chunk, rates)
                if compiled:
                    return gemms + passes(c_in * cells_in + c_out * cells_out, c_in, c_out, m, tiles)
                moves = (a * a * c_in * tiles + m * m * c_out * tiles + c_out * cells_out) / rates.transpose_elems
                transforms = (gemm_seconds(a * a, a * a, c_in * tiles, rates)
                              + gemm_seconds(m * m, a * a, c_out * tiles, rates))
                return gemms + moves + transforms

            # once per call, whatever the batch: the kernels' transform (their 9 taps transposed, then (a², 9) x
            # (9, pairs) per group), in the forward and, flipped, in the data gradient — 38 MB written for a
            # 512 -> 512 layer at m = 4, 14-18 ms on 2 cores, where VGG16's conv5_1 (14x14) at 8 images runs its
            # channel GEMMs in ~25 ms
            kernels = (9 + a * a) * pairs / rates.transpose_elems + g.group * gemm_seconds(a * a, 9, og * cg, rates)
            forward = one_pass(g.in_channels, g.out_channels, in_cells, out_cells) + kernels
            # the weight gradient: both tile transforms and the (m+2)² GEMMs (Og x tiles)·(tiles x Cg) round by
            # round (all partitions' chunks of tiles at once), then, once per call, the (a², pairs) sums
            # transformed back to 9 taps
            transforms = passes(g.in_channels * in_cells + g.out_channels * out_cells, g.in_channels, g.out_channels,
                                m, tiles) if compiled else (
                (a * a * g.in_channels * tiles + m * m * g.out_channels * tiles) / rates.transpose_elems
                + gemm_seconds(a * a, a * a, g.in_channels * tiles, rates)
                + gemm_seconds(a * a, m * m, g.out_channels * tiles, rates))
            rounds = _ceil(g.num, parts * images)
            by_tiles = (g.group * a * a * rounds * gemm_seconds(og, tiles / rounds, cg, rates) + transforms
                        + (a * a + 9) * pairs / rates.transpose_elems
                        + g.group * gemm_seconds(9, a * a, og * cg, rates))
            backward = one_pass(g.out_channels, g.in_channels, out_cells, in_cells) + kernels + min(weights, by_tiles)
            out.append(Estimate("winograd", f"winograd {m}", forward, backward, int(parts * images * per_image)))
        return out

    # ---- configuration -------------------------------------------------------------------------
    def configure(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        ok, why = self.supports(geometry)
        if not ok:
            raise CctError(f"the winograd convolution engine does not apply to this layer: {why}")
        if xp is not None and xp is not np:
            raise CctError("the winograd convolution engine runs on the CPU (numpy arrays) only")
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if geometry == self.geometry and dtype == self.dtype:
            return False
        self.geometry, self.dtype = geometry, dtype
        self._workspace = self._private if self._private is not None else shared_workspace(dtype)
        self._weights_engine = None
        self._wgrad_method = None
        return True

    def describe(self) -> str:
        m = self.tile
        if self._wgrad_method == "lowering":
            return f"winograd F({m}x{m},3x3), weight gradient by {self._weights().describe()}"
        return f"winograd F({m}x{m},3x3)"

    def batch_partitions(self) -> int:
        g = self._geom()
        return len(self._ranges(g.num))

    def representative_images(self) -> int:
        """Each partition's share of the batch up to a chunk of ``MIN_CHUNK_TILES`` tiles: on fewer images the
        channel GEMMs are shorter than in the layer — VGG16's conv4_2 (28x28, 512 -> 512) at 8 images in two
        partitions, measured on one image per partition, F(4x4,3x3) 569 ms scaled to the batch, where it runs
        the layer in 308 (49 tiles per GEMM instead of 147)."""
        g, parts = self._geom(), self.batch_partitions()
        return parts * min(_ceil(g.num, parts), _ceil(MIN_CHUNK_TILES, _image_tiles(g, self.tile)))

    def workspace_bytes(self) -> int:
        return self._workspace.nbytes() if self._workspace is not None else 0

    def _geom(self) -> ConvGeometry:
        if self.geometry is None:
            raise RuntimeError("winograd engine used before configure()")
        return self.geometry

    def _weights(self) -> Any:
        """The lowering engine that computes the weight gradient (its predicted best lowering for it)."""
        if self._weights_engine is None:
            g = self._geom()
            best = min(LoweringEngine.estimates(g, self.dtype), key=lambda e: e.backward_seconds)
            eng = LoweringEngine(int(best.variant.split()[-1]), source="winograd's weight gradient",
                                 workspace=self._private)
            eng.configure(g, self.dtype)
            self._weights_engine = eng
        return self._weights_engine

    def _ranges(self, n: int) -> list[tuple[int, int]]:
        return batch_ranges(n, partitions_for(n, _image_work(self._geom())))

    # ---- the arithmetic ------------------------------------------------------------------------
    def _constants(self, dtype: Any) -> tuple[Any, Any, Any]:
        """``Bᵀ⊗Bᵀ``, ``Aᵀ⊗Aᵀ`` and ``G⊗G`` in ``dtype``."""
        consts = self._consts.get(dtype)
        if consts is None:
            consts = self._consts[dtype] = (self._bb.astype(dtype), self._aa.astype(dtype), self._gg.astype(dtype))
        return consts

    def _transformed_kernels(self, w: Any, flip: bool) -> Any:
        """``Uᵀ`` (G, a², C', O') of the kernels ``w`` (O, Cg, 3, 3): per group and transformed position the
        (input channels x output channels) matrix the tiles (tiles x input channels) are multiplied by;
        ``flip``: the data gradient's kernels (rotated by 180 degrees, input and output channels swapped
        within each group)."""
        g = self._geom()
        G = g.group
        Og, Cg = w.shape[0] // G, w.shape[1]
        k = w.reshape(G, Og, Cg, 9)
        # the 9 taps outermost, (G, 9, C', O'), so that one GEMM per group writes Uᵀ in its layout: transposing the
        # 9 taps, not the a² transformed ones (VGG16's conv3_2, 256 -> 256: 26-40 ms per call where the transform
        # ran in float64 and its (a², O', C') result was transposed and cast, 2-3 ms so)
        taps = k[..., ::-1].transpose(0, 3, 1, 2) if flip else k.transpose(0, 3, 2, 1)
        ins, outs = taps.shape[2], taps.shape[3]
        kt = np.empty(taps.shape, dtype=w.dtype)
        u = np.empty((G, self._gg.shape[0], ins, outs), dtype=w.dtype)
        gg = self._constants(w.dtype)[2]

        def rows(_part: int, i0: int, i1: int) -> None:  # these input channels' rows, on one BLAS thread each
            np.copyto(kt[:, :, i0:i1], taps[:, :, i0:i1])
            for gi in range(G):
                np.matmul(gg, kt[gi, :, i0:i1].reshape(9, -1), out=u[gi, :, i0:i1].reshape(gg.shape[0], -1))

        # over the batch partitions' cores, one BLAS thread each, also where there is one partition (OpenBLAS's own
        # threads would keep spinning into the partitions that follow): a 512 -> 512 layer writes 38 MB of
        # transformed kernels, 25-30 ms a call on one core
        with blas_threads(1):
            run_batch(ins, rows, work=float(G * self._gg.size * outs))
        return u

    def _buffer(self, part: int, name: str, shape: tuple[int, ...], like: Any) -> Any:
        return workspace_view(self._workspace.part(part), name, shape, like)

    def _padded(self, part: int, x: Any, pad: tuple[int, int], rows: int, cols: int) -> Any:
        """``x`` (n, C, H, W) channels innermost, (n, ``rows``, ``cols``, C), its image at offset ``pad`` and
        zeros around it."""
        n, c, h, w = x.shape
        buf = self._buffer(part, "x_pad", (n, rows, cols, c), x)
        (p0, p1), (e0, e1) = pad, (pad[0] + h, pad[1] + w)
        buf[:, :p0] = 0
        buf[:, e0:] = 0
        buf[:, p0:e0, :p1] = 0
        buf[:, p0:e0, e1:] = 0
        np.copyto(buf[:, p0:e0, p1:e1], x.transpose(0, 2, 3, 1))
        return buf

    def _conv(self, part: int, x: Any, u: Any, pad: tuple[int, int], y: Any, bias: Any | None,
              rectify: bool = False) -> None:
        """``y`` (n, O, Ho, Wo) = the 3x3 correlation of ``x`` (n, C, H, W) padded by ``pad`` with the
        transformed kernels ``u`` (G, a², Cg, Og), plus ``bias``; then (``rectify``) ``max(y, 0)``, the chunk
        still in the cache."""
        m, a = self.tile, self.tile + 2
        aa = self._constants(x.dtype)[1]
        n = x.shape[0]
        o, (ho, wo) = y.shape[1], y.shape[2:]
        groups, cg, og = u.shape[0], u.shape[2], u.shape[3]
        th, tw = _ceil(ho, m), _ceil(wo, m)
        p = n * th * tw
        v = self._tiles(part, x, pad, th, tw)
        # compiled: the products laid out tile by tile, then the output tiles' transform, cut, bias and ReLU in one
        # pass into y
        compiled = native.kernels_for(y, *(() if bias is None else (bias,)))
        if compiled is not None:
            tiled = self._buffer(part, "z", (p, a * a, o), x)
            prod = tiled.transpose(1, 0, 2)
        else:
            prod = self._buffer(part, "z", (a * a, p, o), x)
        for gi in range(groups):
            np.matmul(v[:, :, gi * cg:(gi + 1) * cg], u[gi], out=prod[:, :, gi * og:(gi + 1) * og])
        if compiled is not None:
            compiled.winograd_untile(tiled, y, bias, (n, o, ho, wo, th, tw, m), rectify)
            return
        out = self._buffer(part, "col", (m, m, n, th, tw, o), x)  # the input tiles are transformed: free
        np.matmul(aa, prod.reshape(a * a, p * o), out=out.reshape(m * m, p * o))
        full = self._buffer(part, "dwm_tmp", (n, th, m, tw, m, o), x)  # whole tiles, channels innermost
        np.copyto(full, out.transpose(2, 3, 0, 4, 1, 5))
        cells = full.reshape(n, th * m, tw * m, o)[:, :ho, :wo].transpose(0, 3, 1, 2)
        if bias is None:
            np.copyto(y, cells)
        else:
            np.add(cells, bias.reshape(1, o, 1, 1), out=y)
        if rectify:
            relu_into(y, y)

    def _tiles(self, part: int, x: Any, pad: tuple[int, int], th: int, tw: int, out: Any | None = None) -> Any:
        """``V`` (a², n·th·tw, C): the transformed input tiles ``Bᵀ d B`` of ``x`` padded by ``pad``, in the
        "yT" slot (the tiles themselves pass through "col"), or (``out``, (n·th·tw, a², C)) into ``out``.
        Channels innermost, so that every copy moves runs of C contiguous values (gathering the overlapping
        tiles of an (n, C, H, W) array moves runs of one tile row's few cells: 4x slower on CaffeNet's conv3)."""
        m, a = self.tile, self.tile + 2
        bb = self._constants(x.dtype)[0]
        n, c = x.shape[:2]
        p = n * th * tw
        xp_ = self._padded(part, x, pad, th * m + 2, tw * m + 2)
        compiled = native.kernels_for(xp_)
        if compiled is not None:  # each tile's Bᵀ d B straight from the padded input (no gathered copy), tile by tile
            tiled = self._buffer(part, "yT", (p, a * a, c), x) if out is None else out
            compiled.winograd_tiles(xp_, tiled, xp_.shape + (th, tw, m))
            return tiled.transpose(1, 0, 2)
        s = xp_.strides
        tiles = np.lib.stride_tricks.as_strided(xp_, (a, a, n, th, tw, c), (s[1], s[2], s[0], s[1] * m, s[2] * m, s[3]))
        d = self._buffer(part, "col", (a, a, n, th, tw, c), x)
        np.copyto(d, tiles)
        if out is None:
            v = self._buffer(part, "yT", (a * a, p, c), x)
            np.matmul(bb, d.reshape(a * a, p * c), out=v.reshape(a * a, p * c))
            return v
        np.copyto(out.transpose(1, 0, 2), np.matmul(bb, d.reshape(a * a, p * c)).reshape(a * a, p, c))
        return out.transpose(1, 0, 2)

    def _gradient_tiles(self, part: int, dy: Any, out: Any) -> None:
        """``out`` (n·th·tw, a², O) = the transformed output-gradient tiles ``A dY Aᵀ`` of ``dy`` (n, O, Ho, Wo),
        its m x m tiles completed with zeros past the output."""
        m, a = self.tile, self.tile + 2
        n, o, ho, wo = dy.shape
        th, tw = _ceil(ho, m), _ceil(wo, m)
        p = n * th * tw
        dyp = self._buffer(part, "dwm_tmp", (n, th * m, tw * m, o), dy)  # whole tiles: zeros past the output
        if (ho, wo) != (th * m, tw * m):
            dyp[:, ho:] = 0
            dyp[:, :ho, wo:] = 0
        np.copyto(dyp[:, :ho, :wo], dy.transpose(0, 2, 3, 1))
        compiled = native.kernels_for(dyp)
        if compiled is not None:  # each m x m gradient tile's A dY Aᵀ straight from dyp, tile by tile
            compiled.winograd_tiles(dyp, out, dyp.shape + (th, tw, m), True)
            return
        aa = self._constants(dy.dtype)[1]
        dt = self._buffer(part, "col", (m, m, n, th, tw, o), dy)
        np.copyto(dt, dyp.reshape(n, th, m, tw, m, o).transpose(2, 4, 0, 1, 3, 5))
        np.copyto(out.transpose(1, 0, 2), np.matmul(aa.T, dt.reshape(m * m, p * o)).reshape(a * a, p, o))

    def _weight_grad_method(self, x: Any, dy: Any, dw: Any) -> str:
        """How the weight gradient runs: ``"winograd"`` (:meth:`_weight_grad`) or ``"lowering"`` (the lowering
        engine's, :meth:`_weights`) — whichever is faster for this geometry on this machine, measured once on
        the layer's own operands into a scratch gradient (:func:`cct.engines.measured.measured_choice`; without
        measuring, Winograd's).  CaffeNet's conv3 at 64 images, F(2x2,3x3): 63 against 82 ms with AVX2
        OpenBLAS kernels, 49 against 49 ms with AVX-512 ones, whose GEMMs leave the transforms' passes the larger
        share; F(4x4,3x3) with AVX-512 kernels 54 against 48 ms.  One choice whatever the batch size (both ways'
        work grows with the images alike): the engine autotune, which runs the engine on part of the batch, a
        quarter of that and the whole batch, measured it three times — 1.5-2.9 s of the 6.9-7.5 s that
        GoogLeNet's conv2/3x3 at 16 images took to measure, where the engines' steps took 0.1-0.2 s."""
        if self._wgrad_method is None:
            from cct.engines.measured import measured_choice

            scratch = np.zeros_like(dw)
            ways = {"winograd": lambda: self._weight_grad(x, dy, scratch),
                    "lowering": lambda: self._weights().backward(x, dy, None, None, scratch)}
            g = self._geom()
            key = (f"v{WGRAD_MEASURE_VERSION}-m{self.tile}-c{g.in_channels}-o{g.out_channels}-g{g.group}"
                   f"-in{'x'.join(map(str, g.in_shape))}-p{'x'.join(map(str, g.pad))}-{np.dtype(dw.dtype).name}")
            self._wgrad_method = measured_choice("winograd_weight_gradient", key, ways)
        return self._wgrad_method

    def _weight_grad(self, x: Any, dy: Any, dw: Any) -> None:
        """``dw += Gᵀ [Σ_tiles (A dY Aᵀ) ⊙ (Bᵀ d B)] G``: the weight gradient by the transposed algorithm (for the
        3x3 kernel from each tile's m x m gradient and its (m+2)² input cells, the roles of F(m x m, 3 x 3)'s
        transforms exchanged), the sums over tiles and images as a² GEMMs (Og x tiles)·(tiles x Cg) per group —
        2.25x (m = 2) and 4x (m = 4) fewer multiplications than the direct sums.

        The batch runs in rounds of as many images as the partitions' chunks hold together: the partitions
        transform their share of a round's tiles (input and gradient) into one array of the round's tiles, then
        the a² positions' GEMMs over all of the round's tiles are split over the cores (:func:`_position_blocks`),
        each adding into its own rows of the one accumulator.  Per partition, over only its own images, the GEMMs'
        inner dimension would be short — on 16 cores CaffeNet's conv3 makes 64 tiles a partition, 1024 a round
        (one core, AVX2 kernels: 46 against 68 GFLOP/s) — and each partition would need an accumulator of its own
        (16 of conv3's are 226 MB) summed at the end.  Then the small kernel-side transform, over blocks of output
        channels on the cores."""
        g = self._geom()
        m, a = self.tile, self.tile + 2
        G = g.group
        og, cg = g.out_channels // G, g.in_channels // G
        n, per_image = x.shape[0], _image_tiles(g, m)
        parts = len(self._ranges(n))
        round_images = parts * _chunk_images(per_image, parts, _image_bytes(m, x.shape[1], dy.shape[1], dy.shape[2:],
                                                                            x.itemsize))
        acc = self._buffer(0, "dw_acc", (G, a * a, og, cg), dw)
        cores = partitions_for(G * a * a * 4)  # the cores, at most one per block of the finest cut (quarters)
        blocks = _position_blocks(G, a * a, og, cores)
        for r0 in range(0, n, round_images):
            r1 = min(n, r0 + round_images)
            tiles = (r1 - r0) * per_image
            v = self._buffer(0, "yT", (tiles, a * a, x.shape[1]), x)
            u = self._buffer(0, "z", (tiles, a * a, dy.shape[1]), dy)

            def transform(part: int, i0: int, i1: int, r0: int = r0, v: Any = v, u: Any = u) -> None:
                t0, t1 = i0 * per_image, i1 * per_image
                self._tiles(part, x[r0 + i0:r0 + i1], tuple(g.pad), *_tile_grid(g, m), out=v[t0:t1])
                self._gradient_tiles(part, dy[r0 + i0:r0 + i1], u[t0:t1])

            run_partitions(batch_ranges(r1 - r0, parts), transform)

            def products(_part: int, k0: int, k1: int, first: bool = r0 == 0, v: Any = v, u: Any = u) -> None:
                for gi, xi, o0, o1 in blocks[k0:k1]:  # (Og' x tiles)·(tiles x Cg) into the accumulator's rows
                    dyg = u[:, xi, gi * og + o0:gi * og + o1].T
                    xg = v[:, xi, gi * cg:(gi + 1) * cg]
                    if first:
                        np.matmul(dyg, xg, out=acc[gi, xi, o0:o1])
                    else:  # BLAS adds into the accumulator: no product buffer, no pass adding one
                        matmul_accumulate(acc[gi, xi, o0:o1], dyg, xg)
            run_batch(len(blocks), products, parts=cores)
        dw5 = dw.reshape(G, og, cg, 3, 3)  # a view whatever dw's strides: only its first axis is split

        gg_t = self._constants(acc.dtype)[2].T  # (9, a²)
        block = TRANSFORM_BACK_CHANNELS

        def transform_back(_part: int, b0: int, b1: int) -> None:
            """These blocks of output channels' sums: the kernel-side transform (9, a²) · (a², channels) into their
            rows of ``dw`` — on the cores, one BLAS thread each (a 512 -> 512 layer's 9.4 million sums took 20-30
            ms on one core in float64; in the sums' own float32, CaffeNet's conv3 5.8 against 13 ms on one core,
            1e-7 of the largest value apart).  Blocks of a fixed size whatever the cores: the same products, so
            the same bits, however the blocks are shared out."""
            for o0 in range(b0 * block, min(og, b1 * block), block):
                o1 = min(og, o0 + block)
                for gi in range(G):
                    k = gg_t @ acc[gi, :, o0:o1].reshape(a * a, -1)  # (9, channels · Cg)
                    dw5[gi, o0:o1] += k.reshape(3, 3, o1 - o0, cg).transpose(2, 3, 0, 1)
        with blas_threads(1):
            run_batch(_ceil(og, block), transform_back, work=float(G * a * a * cg * block))

    def _in_chunks(self, n: int, per_image: int, fn: Any) -> None:
        """``fn(part, c0, c1, first)`` over the batch partitions, each in chunks of images ``[c0, c1)`` that fit its
        share of the budget (``per_image`` bytes each), but of at least ``MIN_CHUNK_TILES`` tiles;
        ``first``: the partition's first chunk."""
        ranges = self._ranges(n)
        g, m = self._geom(), self.tile
        step = _chunk_images(_image_tiles(g, m), len(ranges), per_image)

        def body(part: int, n0: int, n1: int) -> None:
            for c0 in range(n0, n1, step):
                fn(part, c0, min(n1, c0 + step), c0 == n0)

        run_partitions(ranges, body)

    def _chunked(self, x: Any, u: Any, pad: tuple[int, int], y: Any, bias: Any | None, rectify: bool = False) -> None:
        """:meth:`_conv` over the batch partitions, each in chunks of images that fit its share of the budget."""
        self._in_chunks(x.shape[0], _image_bytes(self.tile, x.shape[1], y.shape[1], y.shape[2:], x.itemsize),
                        lambda part, c0, c1, _first: self._conv(part, x[c0:c1], u, pad, y[c0:c1], bias, rectify))

    # ---- the engine interface -----------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        return self._forward(x, w, b, y, False)

    def forward_rectified(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        """:meth:`forward`, each chunk's output rectified right after it is written."""
        return self._forward(x, w, b, y, True)

    def _forward(self, x: Any, w: Any, b: Any | None, y: Any, rectify: bool) -> Any:
        self._chunked(x, self._transformed_kernels(w, flip=False), tuple(self._geom().pad), y, b, rectify)
        return y

    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        if dw is not None:
            if self._weight_grad_method(x, dy, dw) == "winograd":
                self._weight_grad(x, dy, dw)
            else:
                self._weights().backward(x, dy, None, None, dw)
        if dx is not None:
            g = self._geom()
            self._chunked(dy, self._transformed_kernels(w, flip=True), tuple(2 - p for p in g.pad), dx, None)


def _image_tiles(g: ConvGeometry, m: int) -> int:
    """Output tiles of one image at F(m x m, 3 x 3)."""
    return math.prod(_tile_grid(g, m))


def _tile_grid(g: ConvGeometry, m: int) -> tuple[int, int]:
    """Output tiles of an image at F(m x m, 3 x 3) down and across."""
    return _ceil(g.out_shape[0], m), _ceil(g.out_shape[1], m)


def _position_blocks(groups: int, positions: int, og: int, cores: int) -> list[tuple[int, int, int, int]]:
    """The weight gradient's GEMMs as ``(group, position, o0, o1)`` blocks for ``cores`` cores: each group's
    ``positions`` GEMMs, their ``og`` output channels cut in as many ranges (up to 4, of 32 channels at least)
    as balance the cores best — on 16 cores 36 whole GEMMs leave the busiest core 3 where the mean is 2.25,
    in quarters 9 each."""
    def busiest(b: int) -> float:  # the busiest core's work in whole GEMMs
        return _ceil(groups * positions * b, cores) / b
    cuts = min((b for b in range(1, 5) if b == 1 or og // b >= 32), key=lambda b: (busiest(b), b))
    edges = [og * i // cuts for i in range(cuts + 1)]
    return [(gi, xi, edges[i], edges[i + 1]) for gi in range(groups) for xi in range(positions)
            for i in range(cuts)]


def _chunk_images(tiles: int, parts: int, per_image: int) -> int:
    """Images in a chunk of a partition's share: as many as fit its share of the buffers' budget (``per_image``
    bytes each, ``parts`` partitions), but ``MIN_CHUNK_TILES`` tiles at least (``tiles`` per image)."""
    return max(1, chunk_budget_bytes() // parts // max(per_image, 1), _ceil(MIN_CHUNK_TILES, tiles))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _image_work(g: ConvGeometry) -> float:
    """Direct-convolution flops of one image of ``g`` (what the batch partitions are sized by)."""
    return 2.0 * g.out_channels * (g.in_channels // g.group) * 9 * g.out_count


def _image_bytes(m: int, c_in: int, c_out: int, out_shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of one image's F(m x m, 3 x 3) buffers (padded input, tiles, transformed tiles and products,
    output tiles)."""
    a = m + 2
    th, tw = _ceil(out_shape[0], m), _ceil(out_shape[1], m)
    tiles = a * a * th * tw
    return itemsize * (c_in * (th * m + 2) * (tw * m + 2) + tiles * (2 * c_in + c_out) + c_out * th * m * tw * m)
