"""The convolution engine contract: the geometry of one convolution, an engine's arithmetic and its predicted
cost (see :mod:`cct.engines` for the engines and how layers get them)."""
from __future__ import annotations

import contextlib
import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from cct.elementwise import rectify

T = TypeVar("T")


@contextlib.contextmanager
def scoped_value(var: ContextVar[T], value: T) -> Iterator[None]:
    """``var`` set to ``value`` within the block (this thread or task), restored after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# whether the engines being chosen will run the forward pass alone (a net that runs no backward: TEST phase
# without force_backward), so that each convolution is chosen by its forward time, not a training step's
_forward_only: ContextVar[bool] = ContextVar("cct_forward_only", default=False)


def forward_only() -> bool:
    """Whether the engine choices made now are for a net that runs the forward pass alone."""
    return _forward_only.get()


def choosing_for_forward_only(flag: bool) -> contextlib.AbstractContextManager[None]:
    """Within the block the engines are chosen (predicted, measured, cached) for the forward pass alone when
    ``flag``, else for a training step (forward and backward)."""
    return scoped_value(_forward_only, bool(flag))


def chosen_seconds(forward: float, backward: float) -> float:
    """The time an engine choice weighs: ``forward`` alone under :func:`choosing_for_forward_only`, else the
    training step's ``forward + backward``."""
    return forward if forward_only() else forward + backward


@dataclass(frozen=True)
class ConvGeometry:
    """Shapes of one convolution ``(N, C, *in_shape) → (N, O, *out_shape)``; spatial tuples have one entry
    per spatial axis (possibly none)."""

    num: int
    in_channels: int
    out_channels: int
    group: int
    in_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, ...]
    dilation: tuple[int, ...]

    # the derived shapes, computed once (the engines read them on every call; the fields never change)
    @functools.cached_property
    def num_spatial_axes(self) -> int:
        return len(self.in_shape)

    @functools.cached_property
    def extent(self) -> tuple[int, ...]:
        """Dilated kernel extent per axis: ``dilation*(kernel-1) + 1``."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))

    @functools.cached_property
    def out_shape(self) -> tuple[int, ...]:
        """``(in + 2*pad - extent) // stride + 1`` per axis (the caller checks ``in + 2*pad >= extent``)."""
        return tuple((i + 2 * p - e) // s + 1
                     for i, p, e, s in zip(self.in_shape, self.pad, self.extent, self.stride))

    @functools.cached_property
    def kernel_count(self) -> int:
        return math.prod(self.kernel)

    @functools.cached_property
    def out_count(self) -> int:
        return math.prod(self.out_shape)

    @property
    def is_pointwise(self) -> bool:
        """1x1 kernel, stride 1, no padding: an image's lowered matrix is the image itself, (C, cells)."""
        return all(k == 1 and s == 1 and p == 0 for k, s, p in zip(self.kernel, self.stride, self.pad))


@dataclass(frozen=True)
class Estimate:
    """An engine's predicted cost of one convolution geometry (whole batch), nothing measured.

    ``variant``: what would run (``"lowering 2"``, ``"fft lifted"``); ``workspace_bytes``: the scratch memory
    the engine holds for it (lowered matrices and GEMM results per chunk, or kept spectra)."""

    engine: str
    variant: str
    forward_seconds: float
    backward_seconds: float
    workspace_bytes: int

    @property
    def seconds(self) -> float:
        """Forward + backward (data and weights): one training step of the layer."""
        return self.forward_seconds + self.backward_seconds

    @property
    def chosen_seconds(self) -> float:
        """What an engine choice weighs (:func:`chosen_seconds`): the forward alone for a net that runs no
        backward, else :attr:`seconds`."""
        return chosen_seconds(self.forward_seconds, self.backward_seconds)


class ConvEngine(ABC):
    """The arithmetic of a convolution.  ``configure`` is called from the layer's reshape whenever the
    geometry may have changed; the other methods write into the given output arrays."""

    name: str = "abstract"

    def __init__(self) -> None:
        self.geometry: ConvGeometry | None = None

    def configure(self, geometry: ConvGeometry, dtype: Any = None, xp: Any = None) -> bool:
        """Adopt ``geometry`` (arrays of ``dtype`` from array module ``xp``, numpy when None); engines
        (re)allocate their buffers lazily when it changes.  Returns True when the engine's plan changed (the
        layer then logs :meth:`describe`)."""
        changed = geometry != self.geometry
        self.geometry = geometry
        return changed

    def describe(self) -> str:
        """One line: what this engine runs for the configured geometry and why."""
        return self.name

    def workspace_bytes(self) -> int:
        """Bytes of scratch memory the engine holds (lowered matrices, transposed copies, kept spectra)."""
        return 0

    def batch_partitions(self) -> int:
        """Into how many batch partitions a call on the configured geometry is split (run concurrently)."""
        return 1

    def representative_images(self) -> int:
        """The fewest images of the configured batch a call must hold to run as it does on the whole batch
        (time per image aside from once-per-call work): an image for each batch partition, unless the engine's
        chunks of images need more.  The engine autotune measures part of a batch on no fewer."""
        return self.batch_partitions()

    @classmethod
    def estimates(cls, g: ConvGeometry, dtype: Any = "float32", rates: Any = None, xp: Any = None) -> list[Estimate]:
        """The predicted cost of each variant of this engine that can run ``g`` on arrays of ``xp`` (numpy
        when None) — empty when none can; ``rates``: the machine's (:class:`cct.engines.cost_model.MachineRates`,
        default: calibrated or the defaults)."""
        return []

    @abstractmethod
    def forward(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        """``y[...] = conv(x, w) (+ b broadcast over the channel axis)``; returns ``y``."""

    def forward_rectified(self, x: Any, w: Any, b: Any | None, y: Any) -> Any:
        """:meth:`forward`, then ``y = max(y, 0)`` — a plain ReLU in place right after the convolution, run as one
        step with it (:mod:`cct.exec.fusion`): the bits of the two layers one after the other.  Here the forward and
        then the ReLU's own pass over ``y``; an engine that writes ``y`` in a pass of its own rectifies there, or each
        part of ``y`` while it is still in the cache."""
        self.forward(x, w, b, y)
        return rectify(y)

    @abstractmethod
    def backward(self, x: Any, dy: Any, w: Any, dx: Any | None, dw: Any | None) -> None:
        """Both gradients of one convolution: ``dx[...] = conv_transpose(dy, w)`` (overwrites) and ``dw +=
        correlation of x with dy`` (accumulates), either may be None (its operands then too); engines share
        work between them."""

    def backward_data(self, dy: Any, w: Any, dx: Any) -> Any:
        """``dx[...] = conv_transpose(dy, w)`` (overwrites ``dx``); returns ``dx``."""
        self.backward(None, dy, w, dx, None)
        return dx

    def backward_weights(self, x: Any, dy: Any, dw: Any) -> Any:
        """``dw += correlation of x with dy`` (accumulates); returns ``dw``."""
        self.backward(x, dy, None, None, dw)
        return dw

    def forward_and_backward_weights(self, x: Any, w: Any, y: Any | None, dy: Any, dw: Any | None) -> None:
        """``y[...] = conv(x, w)`` and ``dw += corr(x, dy)`` (either may be None): Deconvolution's backward,
        where the same ``x`` (its top gradient) feeds both; engines may share the work."""
        if dw is not None:
            self.backward_weights(x, dy, dw)
        if y is not None:
            self.forward(x, w, None, y)

    @staticmethod
    def backward_bias(dy: Any, db: Any) -> Any:
        """``db += Σ_{n, spatial} dy[n, o, ...]``; returns ``db``.  The spatial sums are matrix-vector products of
        the ``(images·o, positions)`` rows with a ones vector (Caffe's bias multiplier), over the batch
        partitions with one BLAS thread each (OpenBLAS's own threads would spin on after the call, beside the
        next layer's partitions): 3x-6x faster than numpy's reduction over the strided image and spatial axes
        (CaffeNet's conv1, 64 images: 1.0 vs 3.3 ms), as accurate.  A gradient small enough for one thread is
        summed row by row by the compiled kernels (:mod:`cct.native`, in double precision) where they take it:
        the digits LeNet's 64 x 20 x 8 x 8 and 64 x 50 x 4 x 4, 54-65 -> 39-41 us a call."""
        from cct import native
        from cct.device import get_array_module
        from cct.engines.gemm import SMALL_GEMM_FLOPS, gemm_threads
        from cct.runtime.partition import run_batch

        xp = get_array_module(dy)
        n, o = dy.shape[:2]
        if dy.size == 0:
            return db
        rows = dy.reshape(n * o, -1)
        compiled = native.kernels_for(dy) if 2.0 * dy.size < SMALL_GEMM_FLOPS else None
        if compiled is not None:
            sums = np.empty(n * o, dtype=dy.dtype)
            compiled.row_sums(rows, None, sums, None, rows.shape[1])
            db += sums.reshape(n, o).sum(axis=0)
            return db
        ones = xp.ones(rows.shape[1], dtype=dy.dtype)
        sums = xp.empty(n * o, dtype=dy.dtype)
        if xp is np:
            with gemm_threads(2.0 * dy.size):  # a small layer's single partition: one thread too
                run_batch(n, lambda _p, a, b: np.matmul(rows[a * o:b * o], ones, out=sums[a * o:b * o]),
                          work=rows.shape[1] * o)
        else:
            xp.matmul(rows, ones, out=sums)
        db += sums.reshape(n, o).sum(axis=0)
        return db
