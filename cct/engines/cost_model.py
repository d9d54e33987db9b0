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
machine rates (:class:`MachineRates`: defaults, or measured by :func:`cct.engines.select.calibrate`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cct.engines import ConvGeometry


def _prod(values: tuple[int, ...]) -> int:
    n = 1
    for v in values:
        n *= v
    return n


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

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class MachineRates:
    """Throughputs of the steps (per second, whole machine at the thread count in use)."""

    gemm_flops: float = 6.0e10      # float32 GEMM
    lower_elems: float = 5.0e8      # strided gather into the lowered matrix
    lift_elems: float = 4.0e8       # slice additions (lifting, col2im)
    transpose_elems: float = 6.0e8  # channel-first transposing copies


DEFAULT_RATES = MachineRates()


def layer_costs(g: ConvGeometry, strategy: int, itemsize: int = 4) -> LoweringCost:
    """Counts for ``strategy`` (1, 2, 3) on geometry ``g`` (whole batch ``g.num``), forward + backward."""
    nd = g.num_spatial_axes
    f = {1: 0, 2: min(1, nd), 3: nd}[strategy]
    B, C, O = g.num, g.in_channels, g.out_channels
    kF, kL = _prod(g.kernel[:f]), _prod(g.kernel[f:])
    cols = _prod(g.in_shape[:f]) * _prod(g.out_shape[f:])
    p_in, p_out = _prod(g.in_shape), g.out_count
    gemm = 3 * 2.0 * (O * kF) * (C // g.group * kL) * cols * B
    lowered = 2.0 * C * kL * cols * B if f < nd else 2.0 * C * p_in * B  # forward + weight gradient
    col2im = C * kL * cols * B if f < nd else C * p_in * B
    lifted = 2.0 * O * kF * cols * B if f else 0.0  # lifting adds (fwd) + unlifting copies (bwd)
    transpose = 2.0 * O * p_out * B
    traffic = itemsize * (2 * lowered + 3 * col2im + 3 * lifted + 2 * transpose)
    return LoweringCost(strategy, lowered, gemm, lifted, col2im, transpose, traffic)


def estimate_seconds(cost: LoweringCost, rates: MachineRates = DEFAULT_RATES) -> float:
    """Predicted time of one forward + backward with ``rates``."""
    return (cost.gemm_flops / rates.gemm_flops + cost.lowered_elems / rates.lower_elems
            + (cost.lifted_elems + cost.col2im_elems) / rates.lift_elems
            + cost.transpose_elems / rates.transpose_elems)


def channel_ratio(g: ConvGeometry) -> float:
    """The paper's selector: input over output channels, ``d / o``."""
    return g.in_channels / g.out_channels
