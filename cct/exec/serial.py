"""Caffe's executor: the layers one after the other (``Net::ForwardFromTo`` / ``BackwardFromTo``), each run
by a :class:`LayerRunner`, with the net's per-layer callbacks and its ``debug_info`` lines around it.  With the
plain runner, an in-place ReLU and the MAX pooling after it run as one step backward, a BatchNorm and the
in-place Scale (and ReLU) after it as one step each way, and an Eltwise sum or a Convolution and the in-place ReLU
after it as one step forward (:mod:`cct.exec.fusion`: the same numbers, one pass or one buffer less)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cct.exec.base import Executor, zero_param_diffs
from cct.exec.fusion import backward_pairs, forward_pairs, rectified_convs, rectified_scales, rectified_sums

if TYPE_CHECKING:  # pragma: no cover
    from cct.net import NetCore


class LayerRunner:
    """How one layer runs.  This one calls the layer on the whole batch where its blobs live; the device
    split (:class:`cct.exec.device_split.DeviceSplitRunner`) runs batch-separable layers on device shares."""

    def attach(self, net: NetCore) -> None:
        """Called once with the net the runner serves (it may plan per layer)."""

    def forward_layer(self, net: NetCore, i: int) -> float:
        return net.layers[i].forward_layer(net.bottom_vecs[i], net.top_vecs[i])

    def backward_layer(self, net: NetCore, i: int) -> None:
        net.layers[i].backward_layer(net.top_vecs[i], net.bottom_need_backward[i], net.bottom_vecs[i])

    def backward_rectified(self, net: NetCore, i: int) -> None:
        """Layer ``i`` (a MAX Pooling) and the in-place ReLU below it, as one step."""
        net.layers[i].backward_rectified(net.top_vecs[i], net.bottom_need_backward[i], net.bottom_vecs[i])

    def backward_normalized(self, net: NetCore, i: int, j: int, relu: int | None = None) -> bool:
        """The backwards of ``relu`` (a plain ReLU in place on the top of layer ``j``, or None), of ``j`` (the Scale
        in place on the top of layer ``i``) and of ``i`` (a BatchNorm) as one step where the kernels take them
        (:meth:`cct.layers.normalization.BatchNormLayer.backward_scaled`); False, nothing run, otherwise."""
        return net.layers[i].backward_scaled(net.top_vecs[i], net.bottom_vecs[i], net.layers[j],
                                             rectify=relu is not None)

    def forward_normalized(self, net: NetCore, i: int, j: int, relu: int | None = None) -> bool:
        """Layer ``i`` (a BatchNorm) and ``j``, the Scale in place on its top — and ``relu``, a plain ReLU in
        place after it — as one step where the compiled kernels take them
        (:meth:`cct.layers.normalization.BatchNormLayer.forward_scaled`); False, nothing run, otherwise."""
        norm, scale = net.layers[i], net.layers[j]
        norm.reshape(net.bottom_vecs[i], net.top_vecs[i])
        scale.reshape(net.bottom_vecs[j], net.top_vecs[j])
        if relu is not None:
            net.layers[relu].reshape(net.bottom_vecs[relu], net.top_vecs[relu])
        return norm.forward_scaled(net.bottom_vecs[i], net.top_vecs[i], scale, rectify=relu is not None)

    def forward_rectified(self, net: NetCore, i: int, relu: int) -> bool:
        """Layer ``i`` (an Eltwise or a Convolution) and ``relu``, the plain ReLU in place on its top, as one step
        where the layer takes them (:meth:`cct.layers.eltwise.EltwiseLayer.forward_rectified`: the compiled kernels;
        :meth:`cct.layers.conv.Convolution.forward_rectified`: one bottom); False, nothing run, otherwise."""
        layer = net.layers[i]
        layer.reshape(net.bottom_vecs[i], net.top_vecs[i])
        net.layers[relu].reshape(net.bottom_vecs[relu], net.top_vecs[relu])
        return layer.forward_rectified(net.bottom_vecs[i], net.top_vecs[i])

    def clear_param_diffs(self, net: NetCore) -> None:
        """Zero the learnable parameters' gradients where the layers add into them."""
        zero_param_diffs(net.learnable_params)

    def update_on_device(self, items: Any, update: Any) -> bool:
        """See :meth:`cct.exec.base.Executor.update_on_device`: the plain runner keeps nothing on a device."""
        return False

    def newest(self, blob: Any, what: str) -> Any:
        """See :meth:`cct.exec.base.Executor.newest`."""
        return getattr(blob, what)

    def layer_array_module(self) -> Any:
        """See :meth:`cct.exec.base.Executor.layer_array_module`: the plain runner runs layers where they live."""
        return None

    def describe(self) -> str:
        return "whole batch"


class SerialExecutor(Executor):
    """Layer after layer, each through ``runner`` (default: the plain :class:`LayerRunner`)."""

    def __init__(self, runner: LayerRunner | None = None):
        self.runner = runner if runner is not None else LayerRunner()

    def attach(self, net: NetCore) -> None:
        super().attach(net)
        self.runner.attach(net)
        plain = type(self.runner) is LayerRunner  # other runners split layers their own way
        self._backward_pairs = backward_pairs(net) if plain else {}
        self._forward_pairs = forward_pairs(net) if plain else {}  # Scale -> the BatchNorm below it
        self._normalized = {i: j for j, i in self._forward_pairs.items()}  # BatchNorm -> the Scale above it
        self._rectified = rectified_scales(net, self._forward_pairs) if plain else {}  # Scale -> the ReLU above it
        # Eltwise or Convolution -> the ReLU above it
        self._rectified_tops = {**rectified_sums(net), **rectified_convs(net)} if plain else {}
        # the top layer of each BatchNorm -> Scale (-> ReLU) run: (BatchNorm, Scale, ReLU or None)
        self._scaled_runs = {relu if relu is not None else j: (i, j, relu) for j, i in self._forward_pairs.items()
                             for relu in (self._rectified.get(j),)}

    def layer_array_module(self) -> Any:
        return self.runner.layer_array_module()

    def fused_backward_pairs(self) -> dict[int, int]:
        """The pairs this executor runs as one backward step (:mod:`cct.exec.fusion`): MAX Pooling index -> the
        index of the in-place ReLU below it."""
        return dict(self._backward_pairs)

    def fused_below(self, net: NetCore, i: int, end: int = 0) -> int | None:
        """The index of the ReLU whose backward layer ``i``'s runs when a backward pass down to ``end`` reaches
        ``i`` (both need it and pass their gradient down), else None."""
        relu = self._backward_pairs.get(i)
        if relu is None or relu < end or not (net.layer_need_backward[i] and net.layer_need_backward[relu]
                                              and net.bottom_need_backward[i][0]
                                              and net.bottom_need_backward[relu][0]):
            return None
        return relu

    def backward_fused(self, net: NetCore, i: int, end: int = 0) -> tuple[int, int, list[int]] | None:
        """Runs the fused backward step layer ``i`` heads in a backward pass down to ``end`` — a MAX pooling with the
        in-place ReLU below it, or a ReLU (or Scale) with the Scale and BatchNorm below it — where every layer of
        it needs its backward and passes its gradient down, returning (the next layer to run, the layer whose
        step it is, the other layers it ran); None, nothing run, where ``i`` heads none (or its kernels do not
        take the arrays)."""
        relu = self.fused_below(net, i, end)
        if relu is not None:
            self.runner.backward_rectified(net, i)
            return relu - 1, i, [relu]
        run = self._scaled_runs.get(i)
        if run is None or run[0] < end:
            return None
        norm, scale, relu = run
        layers = [k for k in (relu, scale, norm) if k is not None]
        if not all(net.layer_need_backward[k] and net.bottom_need_backward[k][0] for k in layers):
            return None
        if not self.runner.backward_normalized(net, norm, scale, relu):
            return None
        return norm - 1, norm, [k for k in layers if k != norm]

    def forward_step(self, net: NetCore, i: int, start: int, end: int, fuse: bool = True) -> tuple[int, float]:
        """Layer ``i`` of a forward pass over ``start..end`` — a BatchNorm with the Scale above it (and the ReLU
        above that), or an Eltwise with the ReLU above it, as one step where that applies and ``fuse`` (nothing
        looks at the blob between them) — returning the index of the next layer to run and the loss."""
        above = self._normalized.get(i) if fuse else None
        if above is not None and above <= end:
            relu = self._rectified.get(above)
            relu = relu if relu is not None and relu <= end else None
            if self.runner.forward_normalized(net, i, above, relu):
                return (above if relu is None else relu) + 1, 0.0
        relu = self._rectified_tops.get(i) if fuse else None
        if relu is not None and relu <= end and self.runner.forward_rectified(net, i, relu):
            return relu + 1, 0.0
        below = self._forward_pairs.get(i) if fuse else None
        if below is not None and below >= start:  # the BatchNorm before it ran in this pass: its copy is current
            net.layers[i].input_kept_in(net.layers[below].kept_output())
        return i + 1, self.runner.forward_layer(net, i)

    def forward(self, net: NetCore, start: int, end: int) -> float:
        loss = 0.0
        before, after = net.before_forward_hooks, net.after_forward_hooks
        fuse = not (before or after or net.debug_info)
        i = start
        while i <= end:
            for cb in before:
                cb(i)
            following, layer_loss = self.forward_step(net, i, start, end, fuse)
            loss += layer_loss
            if net.debug_info:
                net.forward_debug_info(i)
            for cb in after:
                cb(i)
            i = following
        return loss

    def backward(self, net: NetCore, start: int, end: int) -> None:
        before, after, runner, need = net.before_backward_hooks, net.after_backward_hooks, self.runner, \
            net.layer_need_backward
        fuse = not (before or after or net.debug_info)
        i = start
        while i >= end:
            fused = self.backward_fused(net, i, end) if fuse else None
            if fused is not None:
                i = fused[0]
                continue
            for cb in before:
                cb(i)
            if need[i]:
                runner.backward_layer(net, i)
                if net.debug_info:
                    net.backward_debug_info(i)
            for cb in after:
                cb(i)
            i -= 1

    def clear_param_diffs(self, net: NetCore) -> None:
        self.runner.clear_param_diffs(net)

    def update_on_device(self, items: Any, update: Any) -> bool:
        return self.runner.update_on_device(items, update)

    def newest(self, blob: Any, what: str) -> Any:
        return self.runner.newest(blob, what)

    def describe(self) -> str:
        return f"layer by layer ({self.runner.describe()})"
