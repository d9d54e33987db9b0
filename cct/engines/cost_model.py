"""The cost of CcT's three lowerings (Hadjis et al. 2015, Fig. 6 and its cost table), per layer.

For input ``n×n×d``, kernel ``k×k×d×o``, output ``m×m×o`` and batch ``B`` (2-D, stride 1), per image:

    strategy               lowered matrix     GEMM (forward)            lifting
    1 expensive lowering   m²·k²d             2·m²·k²d·o FLOPs          none
    2 balanced             n·m·kd             2·n·m·kd·ko FLOPs         k slices of m²·o
    3 expensive lifting    n²·d (the input)   2·n²·d·k²o FLOPs          k² slices of m²·o

so lowering costs grow with ``d·k²`` and lifting costs with ``o·k²``: a layer with few input channels and
many outputs (``d/o`` small) lowers cheaply (type 1); many inputs and few outputs (``d/o`` large) lift
cheaply (type 3); type 2 sits between.  The backward passes are the adjoints of the same steps and cost the
same data movement again, plus two GEMMs.  :func:`layer_costs` generalises the table to the engine's
geometry (groups, stride and dilation along lowered axes, padding, N-D; lifted axes have stride 1, see
:func:`cct.engines.lowering.strategy_fallback`) and :func:`estimate_seconds` turns the counts into time with
machine rates (:class:`MachineRates`: defaults, or measured by :func:`cct.engines.autotune.calibrate`).

GEMM speed depends on shape: a GEMM with few output rows, a short inner dimension or few output columns runs
far below the machine's peak (the paper's d/o extremes: type 3 at small d has inner dimension d, type 1 at
small o has o output rows).  Each of the three GEMMs runs at ``gemm_flops · e(rows, m0) · e(inner, k0) ·
e(cols, n0)`` with ``e(x, x0) = x / (x + x0)`` (:func:`gemm_seconds`), the half-speed sizes ``m0, k0, n0``
calibrated per machine like the rates.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from cct.engines.base import ConvGeometry, chosen_seconds


@dataclass(frozen=True)
class LoweringCost:
    """Element counts of one forward + backward (data and weights) pass of one strategy over a batch."""

    strategy: int
    lowered_elems: float     # written into the lowered matrix (forward and again for the weight gradient)
    gemm_flops: float        # 3 GEMMs: forward, backward data, backward weights
    lifted_elems: float      # added in lifting slices (forward) and copied in unlifting (backward)
    col2im_elems: float      # added back into the input gradient (adjoint of lowering)
    transpose_elems: float   # channel-first transpositions of y and dy (and x for type 3)
    traffic_bytes: float     # memory traffic of the non-GEMM steps (reads + writes)
    # the three GEMMs (forward, backward data, backward weights) as (rows, inner, cols) of one group's
    # product over the whole batch (each runs ``group`` times; partitions split the batch columns)
    gemm_shapes: tuple[tuple[int, int, int], ...] = ()
    groups: int = 1
    # the forward and data-gradient GEMMs cut into this many column pieces per group, at least (type 2's
    # lifting by per-image GEMMs: one per image and lifted kernel offset)
    gemm_pieces: tuple[int, int] = (1, 1)
    # of lifted_elems and transpose_elems, the forward's (None: half of each)
    lifted_forward: float | None = None
    transpose_forward: float | None = None
    # one image's lowering (forward and weight gradient) runs over the cores, whatever the partitions (the compiled
    # 2-D lowering outside the batch partitions)
    lowering_over_cores: bool = False

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class MachineRates:
    """Throughputs of the steps (per second, whole machine at the thread count in use)."""

    gemm_flops: float = 1.2e11      # float32 GEMM, big square shapes
    lower_elems: float = 1.4e9      # strided gather into the lowered matrix
    lift_elems: float = 9.0e8       # slice additions (lifting) and copies (unlifting)
    transpose_elems: float = 1.5e9  # channel-first transposing copies
    gemm_m0: float = 15.0           # GEMM shape: output rows, inner dimension and output columns at which
    gemm_k0: float = 20.0           # the GEMM runs at half speed (see gemm_seconds)
    gemm_n0: float = 30.0
    col2im_elems: float = 6.5e8     # slice additions back into the input gradient
    fft_flops: float = 8e9          # scipy.fft on lines of length 16-40 (5·n·log2 n per complex line)
    fft_call_s: float = 4e-3        # the FFT engine's fixed cost per forward + backward of a layer
    part_share: float = 0.5         # the copy passes' rate of one partition running alone, as a share of the rates
    # above (all partitions busy): a layer with fewer partitions runs them at parts · part_share of those rates
    # (defaults: a 2-core AVX2 machine; calibrate() measures the machine it runs on)


DEFAULT_RATES = MachineRates()


def layer_costs(g: ConvGeometry, strategy: int, itemsize: int = 4, per_image_lifting: bool = False) -> LoweringCost:
    """Counts for ``strategy`` (1, 2, 3) on geometry ``g`` (whole batch ``g.num``), forward + backward.

    ``per_image_lifting`` (type 2 as the engine runs it on wide host outputs:
    :func:`cct.engines.lowering.lifts_per_image`): the forward and the data gradient are one GEMM per image,
    group and lifted kernel offset, each over the output cells that offset reaches (about the image's output;
    ``O/group`` rows, not ``O/group·k``), which sum the lifting themselves and write the output where it lies —
    no forward lifting or transposing pass.  Type 1 of a 1x1 kernel without padding lowers and transposes nothing
    but a stride's subsample: its GEMMs run image by image on the blobs themselves."""
    nd = g.num_spatial_axes
    f = {1: 0, 2: min(1, nd), 3: nd}[strategy]
    B, C, O = g.num, g.in_channels, g.out_channels
    kF, kL = math.prod(g.kernel[:f]), math.prod(g.kernel[f:])
    cols = math.prod(g.in_shape[:f]) * math.prod(g.out_shape[f:])
    p_in, p_out = math.prod(g.in_shape), g.out_count
    M, K, N = O // g.group * kF, C // g.group * kL, cols * B
    gemm = 3 * 2.0 * (O * kF) * (C // g.group * kL) * cols * B
    lowered = 2.0 * C * kL * cols * B if f < nd else 2.0 * C * p_in * B  # forward + weight gradient
    col2im = C * kL * cols * B if f < nd else C * p_in * B
    lifted = 2.0 * O * kF * cols * B if f else 0.0  # lifting adds (fwd) + unlifting copies (bwd)
    transpose = 2.0 * O * p_out * B
    traffic = itemsize * (2 * lowered + 3 * col2im + 3 * lifted + 2 * transpose)
    shapes = ((M, K, N), (K, M, N), (K, N, M))
    over = B == 1 and nd == 2 and f < nd  # the compiled 2-D lowering splits one image's channels over the cores
    if strategy == 1 and kL == 1 and not any(g.pad):  # the GEMMs read and write the blobs where they lie, image by
        # image — strided, from a subsample of the input (forward and weight gradient) and into one (scattered back)
        sub = 0.0 if g.is_pointwise else 1.0
        lowered, col2im = sub * 2.0 * C * cols * B, sub * C * p_in * B
        return LoweringCost(strategy, lowered, gemm, 0.0, col2im, 0.0, itemsize * (2 * lowered + 3 * col2im), shapes,
                            g.group, (B, B))
    if per_image_lifting and strategy == 2:  # backward's unlifting and transposition of dy remain
        lifted, transpose = lifted / 2, transpose / 2
        traffic = itemsize * (2 * lowered + 3 * col2im + 3 * lifted + 2 * transpose)
        cells = kF * p_out * B  # every offset's output cells, all images
        shapes = ((O // g.group, K, cells), (K, O // g.group, cells), (K, N, M))
        return LoweringCost(strategy, lowered, gemm, lifted, col2im, transpose, traffic, shapes, g.group,
                            (B * kF, B * kF), lifted_forward=0.0, transpose_forward=0.0, lowering_over_cores=over)
    return LoweringCost(strategy, lowered, gemm, lifted, col2im, transpose, traffic, shapes, g.group,
                        lowering_over_cores=over)


def _eff(x: float, x0: float) -> float:
    return x / (x + x0) if x > 0 else 0.0


def gemm_seconds(rows: float, inner: float, cols: float, rates: MachineRates = DEFAULT_RATES) -> float:
    """Predicted time of one ``(rows × inner) · (inner × cols)`` float32 GEMM."""
    eff = _eff(rows, rates.gemm_m0) * _eff(inner, rates.gemm_k0) * _eff(cols, rates.gemm_n0)
    return 2.0 * rows * inner * cols / (rates.gemm_flops * max(eff, 1e-6))


def pass_seconds(cost: LoweringCost, rates: MachineRates = DEFAULT_RATES, parts: int = 1) -> tuple[float, float]:
    """Predicted (forward, backward) seconds with ``rates``: the forward GEMM, lowering and lifting, then the
    data and weight GEMMs, the weight gradient's lowering, the unlifting and col2im.  ``parts`` batch
    partitions split the batch columns of the GEMMs (each runs ``1/parts`` of them on ``1/parts`` of the
    machine, all at once), or the GEMMs' own pieces do where there are more of them; the weight gradient is
    the faster of its two orientations (``col · dZᵀ`` or ``dZ · colᵀ``: the engine measures both and keeps
    the faster).  The copy passes (lowering, lifting, transposing, col2im) run on the partitions' threads, so a
    layer with fewer partitions than the machine (one 3-D image on 16 cores) runs them at ``parts ·
    part_share`` of the machine's rates — except one 2-D image's lowering, which the compiled im2col splits over
    the cores (``lowering_over_cores``)."""
    gemms = [0.0, 0.0, 0.0]
    if cost.gemm_shapes:
        p = max(1, parts)
        # forward and data GEMMs have the batch in their output columns, the weight GEMM in its inner dimension
        for i, (rows, inner, cols) in enumerate(cost.gemm_shapes):
            if i == 2:
                gemms[i] = cost.groups * p * min(gemm_seconds(rows, inner / p, cols, rates),
                                                 gemm_seconds(cols, inner / p, rows, rates))
            else:
                split = max(p, cost.gemm_pieces[i])
                gemms[i] = cost.groups * split * gemm_seconds(rows, inner, cols / split, rates)
    else:
        gemms = [cost.gemm_flops / 3 / rates.gemm_flops] * 3
    lifted_fwd = cost.lifted_elems / 2 if cost.lifted_forward is None else cost.lifted_forward
    transpose_fwd = cost.transpose_elems / 2 if cost.transpose_forward is None else cost.transpose_forward
    # the copy passes run on the partitions' threads: fewer partitions than the machine's reach their share
    spread = min(1.0, rates.part_share * max(1, parts))
    lowering = cost.lowered_elems / 2 / rates.lower_elems  # forward, and again for the weight gradient
    if not cost.lowering_over_cores:
        lowering /= spread
    forward = lowering + (lifted_fwd / rates.lift_elems + transpose_fwd / rates.transpose_elems) / spread
    backward = lowering + ((cost.lifted_elems - lifted_fwd) / rates.lift_elems
                           + (cost.transpose_elems - transpose_fwd) / rates.transpose_elems
                           + cost.col2im_elems / rates.col2im_elems) / spread
    return gemms[0] + forward, gemms[1] + gemms[2] + backward


def estimate_seconds(cost: LoweringCost, rates: MachineRates = DEFAULT_RATES, parts: int = 1) -> float:
    """Predicted time of one forward + backward (:func:`pass_seconds`, summed) — of the forward alone while
    choosing for a net that runs no backward (:func:`cct.engines.base.choosing_for_forward_only`)."""
    return chosen_seconds(*pass_seconds(cost, rates, parts))


def channel_ratio(g: ConvGeometry) -> float:
    """The paper's selector: input over output channels, ``d / o``."""
    return g.in_channels / g.out_channels
