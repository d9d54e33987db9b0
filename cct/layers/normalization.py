"""Normalization layers: BatchNorm and MVN (mean-variance normalization).

Neither has a learned scale or shift; Caffe nets follow them with a Scale layer (``bias_term: true``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cct import native
from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb
from cct.runtime.partition import run_channel_blocks


@register("BatchNorm")
class BatchNormLayer(Layer):
    """Normalizes each channel to zero mean and unit variance: ``y = (x - μ) / sqrt(σ² + eps)``.

    Bottom x: ``(N, C, ...)`` (a 1-D bottom is one channel); top y: same shape.  Statistics are taken
    per channel over N and all spatial axes.

    * Batch statistics (``use_global_stats`` false; the default in TRAIN): μ, σ² (biased) of this batch,
      and the running sums are updated: ``s = maf*s + 1``, ``m_sum = μ + maf*m_sum``,
      ``v_sum = (m/(m-1))*σ² + maf*v_sum`` with ``m = count/C`` (factor 1 when m == 1).
      Backward: ``bd = (td - mean(td) - y*mean(td*y)) / sqrt(σ²+eps)``.
    * Global statistics (the default in TEST): ``μ = m_sum/s``, ``σ² = v_sum/s`` (0 when s == 0);
      backward ``bd = td / sqrt(σ²+eps)``.

    Blobs (never learned: setup forces ``lr_mult: 0``): ``[0]`` mean sum (C,), ``[1]`` variance sum (C,),
    ``[2]`` scale factor s (1,), all zero-initialised.  Parameters (``batch_norm_param``):
    ``use_global_stats``, ``moving_average_fraction`` maf (0.999), ``eps`` (1e-5).  In-place supported.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = property(lambda self: self.use_global_stats)  # batch statistics otherwise

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.batch_norm_param
        self.maf = p.moving_average_fraction
        self.eps = p.eps
        self.use_global_stats = (p.use_global_stats if p.HasField("use_global_stats")
                                 else self.phase == pb.TEST)
        if bottom[0].num_axes == 0:
            raise CctError("BatchNorm: the bottom needs at least one axis")
        self.channels = 1 if bottom[0].num_axes == 1 else bottom[0].shape[1]
        shapes = [(self.channels,), (self.channels,), (1,)]
        if self.blobs:
            got = [tuple(b.shape) for b in self.blobs]
            if got != shapes:
                raise ParamError("blobs", f"BatchNorm expects blobs of shapes {shapes} (mean sum, variance "
                                          f"sum, scale factor) for {self.channels} channels, got {got}")
        else:
            for shape in shapes:
                self.blobs.append(Blob(shape))  # zero-filled
        # The statistics are not parameters: lr_mult 0 on all three (added where missing, as Caffe does).
        for i in range(len(self.blobs)):
            if len(self.layer_param.param) == i:
                self.layer_param.param.add().lr_mult = 0.0
            elif (lr := self.layer_param.param[i].lr_mult) != 0:
                raise ParamError(f"param[{i}].lr_mult", f"cannot configure batch normalization statistics as "
                                                        f"layer parameters (lr_mult must be 0, got {lr})")
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        b = bottom[0]
        channels = 1 if b.num_axes == 1 else b.shape[1] if b.num_axes else None
        if channels != self.channels:
            raise CctError(f"BatchNorm: bottom {b.shape_string()} does not have the {self.channels} channels "
                           f"the layer was set up with")
        top[0].reshape(b.shape)
        # y, kept for the batch statistics' backward: a later in-place layer may overwrite the top (the global
        # statistics' backward needs only the deviations)
        self._x_norm = None if self.use_global_stats else \
            _buffer(getattr(self, "_x_norm", None), get_array_module(b.data), b.shape, b.dtype)

    def _view(self, a: Any) -> Any:
        """``a`` as ``(N, C, spatial)``."""
        return a.reshape(a.shape[0], self.channels, -1)

    def kept_output(self) -> Any | None:
        """The copy of its top the last forward kept for backward (batch statistics; None with global ones)."""
        return self._x_norm

    def forward_statistics(self, bottom: Blob) -> tuple[Any, Any]:
        """The forward's per-channel mean and standard deviation ``sqrt(σ² + eps)`` (kept for backward): the stored
        ones, or the batch's, which update the running sums."""
        xp = get_array_module(bottom.data)
        if self.use_global_stats:
            s = self.blobs[2].data[0]
            factor = 0 if s == 0 else 1 / s
            mean = self.blobs[0].data * factor
            var = self.blobs[1].data * factor
        else:
            mean, var = self._batch_statistics(self._view(bottom.data))
            self.blobs[2].data[...] *= self.maf
            self.blobs[2].data[...] += 1
            self.blobs[0].data[...] *= self.maf
            self.blobs[0].data[...] += mean
            m = bottom.count // self.channels
            correction = m / (m - 1) if m > 1 else 1.0
            self.blobs[1].data[...] *= self.maf
            self.blobs[1].data[...] += correction * var
        self._std = std = xp.sqrt(var + self.eps)
        return mean, std

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        x = self._view(bottom[0].data)
        y = self._view(top[0].data)
        mean, std = self.forward_statistics(bottom[0])
        mean_c, std_c = mean[:, None], std[:, None]
        xn = None if self._x_norm is None else self._view(self._x_norm)
        compiled = native.kernels_for(x, y, mean, std, *(() if xn is None else (xn,)))

        def normalize(_part: int, i: slice, c: slice) -> None:  # y = (x - μ) / σ, and the kept copy
            if compiled is not None:
                compiled.normalize_rows(x[i, c], mean[c], std[c], y[i, c], None if xn is None else xn[i, c], x.shape[2])
                return
            out = y[i, c] if xn is None else xn[i, c]
            xp.subtract(x[i, c], mean_c[c], out=out)
            out /= std_c[c]
            if xn is not None:
                xp.copyto(y[i, c], out)

        run_channel_blocks(x, normalize)

    def forward_scaled(self, bottom: list[Blob], top: list[Blob], scale: Any, rectify: bool = False) -> bool:
        """This forward, then ``scale``'s (a per-channel Scale in place on the top: :mod:`cct.exec.fusion`) — and,
        ``rectify``, a plain ReLU's in place after it — in one pass of the compiled kernels: the normalized values
        kept where both backwards read them (this layer's copy with batch statistics, else the Scale's own), the
        scaled (rectified) values in the top; the bits of the forwards one after the other.  False, nothing
        computed, where the kernels do not take the arrays or the Scale is not per channel on this ``(N, C, S)``
        view."""
        y = self._view(top[0].data)
        operands = scale.channel_operands(top[0])
        if operands is None or tuple(scale.geometry) != y.shape:
            return False
        s, bias = operands
        scale.input_kept_in(self.kept_output())
        kept, _ = scale.keep_input(top[0].data)  # copied below (the normalized values are the Scale's input)
        x, copy = self._view(bottom[0].data), self._view(kept)
        compiled = native.kernels_for(x, y, copy, s, *(() if bias is None else (bias,)))
        if compiled is None:
            return False
        mean, std = self.forward_statistics(bottom[0])
        cells = x.shape[2]
        run_channel_blocks(x, lambda _p, i, c: compiled.normalize_scale_rows(
            x[i, c], mean[c], std[c], s[c], None if bias is None else bias[c], y[i, c], copy[i, c], cells, rectify))
        return True

    def _batch_statistics(self, x: Any) -> tuple[Any, Any]:
        """Per channel mean and biased variance of ``x`` (N, C, S), in x's dtype: each image's mean and sum of
        squared deviations from it, taken block by block in the partitions (one read of x), then combined in
        image order — ``Σ m2_i + S·Σ (μ_i - μ)²`` — so that every partition count gives the same numbers."""
        xp = get_array_module(x)
        n, c, s = x.shape
        means, m2 = xp.empty((n, c), dtype=x.dtype), xp.empty((n, c), dtype=x.dtype)
        ones = xp.ones(s, dtype=x.dtype)
        scratch: dict[int, Any] = {}
        compiled = native.kernels_for(x, means, m2)

        def per_image(part: int, i: slice, ch: slice) -> None:
            if compiled is not None:
                compiled.row_moments(x[i, ch], means[i, ch], m2[i, ch], s)
                return
            rows = x[i, ch].reshape(-1, s)
            mu = xp.matmul(rows, ones)
            mu /= s
            d = _scratch(scratch, part, rows)
            xp.subtract(rows, mu[:, None], out=d)
            shape = means[i, ch].shape
            means[i, ch] = mu.reshape(shape)
            m2[i, ch] = xp.einsum("rs,rs->r", d, d).reshape(shape)

        run_channel_blocks(x, per_image)
        means64 = means.astype(xp.float64)
        mean = means64.mean(axis=0)
        var = (m2.sum(axis=0, dtype=xp.float64) + s * ((means64 - mean) ** 2).sum(axis=0)) / (n * s)
        return mean.astype(x.dtype), var.astype(x.dtype)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        body, finish = self.backward_steps(top, bottom)
        run_channel_blocks(self._view(top[0].diff), body)
        finish()

    def backward_steps(self, top: list[Blob], bottom: list[Blob]) -> tuple[Any, Any]:
        """This backward as ``(body, finish)``: ``body(part, images, channels)`` on one block of the ``(N, C, S)``
        view — with global statistics the block's gradient ``bd = td / σ``, with batch statistics its ``Σ td``
        and ``Σ td·y`` per image and channel —, ``finish()`` what follows every block (batch statistics: the
        means, combined in image order, then the pass ``bd = (td - mean(td) - y·mean(td·y)) / σ``)."""
        xp = get_array_module(top[0].diff)
        td = self._view(top[0].diff)
        bd = self._view(bottom[0].diff)  # may be td itself (in place): each step below is elementwise
        std = self._std
        std_c = std[:, None]
        n, c, s = td.shape
        if self.use_global_stats:
            compiled = native.kernels_for(td, bd, std)

            def scale(_part: int, i: slice, ch: slice) -> None:
                if compiled is not None:
                    compiled.normalize_rows(td[i, ch], None, std[ch], bd[i, ch], None, s)
                else:
                    xp.divide(td[i, ch], std_c[ch], out=bd[i, ch])

            return scale, lambda: None
        y = self._view(self._x_norm)
        sums, dots = xp.empty((n, c), dtype=td.dtype), xp.empty((n, c), dtype=td.dtype)
        ones = xp.ones(s, dtype=td.dtype)
        compiled = native.kernels_for(td, bd, y, std, sums, dots)

        def per_image(_part: int, i: slice, ch: slice) -> None:  # Σ td and Σ td·y per image and channel
            if compiled is not None:
                compiled.row_sums(td[i, ch], y[i, ch], sums[i, ch], dots[i, ch], s)
                return
            rows_td, rows_y = td[i, ch].reshape(-1, s), y[i, ch].reshape(-1, s)
            shape = sums[i, ch].shape
            sums[i, ch] = xp.matmul(rows_td, ones).reshape(shape)
            dots[i, ch] = xp.einsum("rs,rs->r", rows_td, rows_y).reshape(shape)

        def finish() -> None:
            m = n * s
            mean_td = (sums.sum(axis=0, dtype=xp.float64) / m).astype(td.dtype)
            mean_tdy = (dots.sum(axis=0, dtype=xp.float64) / m).astype(td.dtype)
            scratch: dict[int, Any] = {}

            def apply(part: int, i: slice, ch: slice) -> None:  # bd = (td - mean(td) - y·mean(td·y)) / σ
                if compiled is not None:
                    compiled.normalize_backward_rows(td[i, ch], y[i, ch], mean_tdy[ch], mean_td[ch], std[ch],
                                                     bd[i, ch], s)
                    return
                tmp = _scratch(scratch, part, y[i, ch])
                xp.multiply(y[i, ch], mean_tdy[ch, None], out=tmp)
                tmp += mean_td[ch, None]
                xp.subtract(td[i, ch], tmp, out=bd[i, ch])
                bd[i, ch] /= std_c[ch]

            run_channel_blocks(td, apply)

        return per_image, finish

    def backward_scaled(self, top: list[Blob], bottom: list[Blob], scale: Any, rectify: bool = False) -> bool:
        """The backwards of a plain ReLU in place on the top (``rectify``), of ``scale`` (a per-channel Scale in
        place on it: :mod:`cct.exec.fusion`) and of this layer, run block by block through all three (the ReLU's
        mask, the Scale's sums and product, this layer's sums — or, with global statistics, its whole gradient — on
        each block while it is in the core's cache), then this layer's last pass: the bits of the three backwards
        one after the other (the same steps on every value, each row's sums alone and combined in image order).
        False, nothing computed, where the Scale is not per channel on this ``(N, C, S)`` view or the ReLU's
        kernel does not take the arrays."""
        td, y = self._view(top[0].diff), self._view(top[0].data)
        if scale.channel_operands(top[0]) is None or tuple(scale.geometry) != td.shape:
            return False
        compiled = native.kernels_for(td, y)
        if rectify and compiled is None:
            return False
        scale_body, scale_finish = scale.backward_rows_steps(top[0], [True], top[0])
        norm_body, norm_finish = self.backward_steps(top, bottom)

        def body(part: int, i: slice, c: slice) -> None:
            if rectify:  # the ReLU's dy·(y > 0) in place, one image's channel rows (contiguous) at a time
                for image in range(i.start, i.stop):
                    compiled.relu_backward(y[image, c], td[image, c], td[image, c])
            scale_body(part, i, c)
            norm_body(part, i, c)

        run_channel_blocks(td, body)
        scale_finish()
        norm_finish()
        return True


@register("MVN")
class MVNLayer(Layer):
    """Mean-variance normalization per item and channel: ``y = (x - μ) / (sqrt(E[(x-μ)²]) + eps)``.

    Bottom x: up to 4-D, read as legacy ``(num, channels, height, width)``; top: that 4-D shape.
    Statistics over H×W for each (n, c), or over C×H×W for each n with ``across_channels``.  Note that
    eps is added to the standard deviation, not the variance (Caffe).

    Backward: with ``normalize_variance`` ``bd = (td - mean(td) - y*mean(td*y)) / (std + eps)``
    (Caffe's formula; it reads y from the top's data as Caffe does), else ``bd = td - mean(td)``.
    Parameters (``mvn_param``): ``normalize_variance`` (true), ``across_channels`` (false),
    ``eps`` (1e-9).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = True

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.mvn_param
        self.normalize_variance = p.normalize_variance
        self.across_channels = p.across_channels
        self.eps = p.eps

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        b = bottom[0]
        if b.num_axes > 4:
            raise CctError(f"MVN: bottom {b.shape_string()} has more than 4 axes (MVN uses legacy 4-D "
                           f"shapes)")
        # Caffe sizes the top with the legacy accessors: the top is always 4-D (in place, so is the bottom).
        top[0].reshape((b.num, b.channels, b.height, b.width))
        self.rows = b.num if self.across_channels else b.num * b.channels

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        xp = get_array_module(bottom[0].data)
        x = bottom[0].data.reshape(self.rows, -1)
        y = top[0].data.reshape(self.rows, -1)
        mean = x.mean(axis=1)
        xp.subtract(x, mean[:, None], out=y)
        if self.normalize_variance:
            var = xp.einsum("ij,ij->i", y, y) / y.shape[1]
            self._std = xp.sqrt(var) + self.eps
            y /= self._std[:, None]

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = get_array_module(top[0].diff)
        td = top[0].diff.reshape(self.rows, -1)
        bd = bottom[0].diff.reshape(self.rows, -1)  # may alias td (in place): elementwise steps only
        dim = td.shape[1]
        mean_td = td.sum(axis=1) / dim
        if not self.normalize_variance:
            xp.subtract(td, mean_td[:, None], out=bd)
            return
        y = top[0].data.reshape(self.rows, -1)
        mean_tdy = xp.einsum("ij,ij->i", td, y) / dim
        tmp = y * mean_tdy[:, None]
        tmp += mean_td[:, None]
        xp.subtract(td, tmp, out=bd)
        bd /= self._std[:, None]


def _scratch(kept: dict[int, Any], part: int, like: Any) -> Any:
    """A scratch array shaped like ``like`` for partition ``part``: a view of one kept in ``kept`` for the call."""
    buf = kept.get(part)
    if buf is None or buf.size < like.size:
        buf = kept[part] = get_array_module(like).empty(like.size, dtype=like.dtype)
    return buf[:like.size].reshape(like.shape)


def _buffer(buf: Any, xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A scratch array of ``shape``, reusing ``buf`` when it already fits."""
    if buf is not None and buf.shape == tuple(shape) and buf.dtype == dtype and get_array_module(buf) is xp:
        return buf
    return xp.empty(shape, dtype=dtype)
