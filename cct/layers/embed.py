"""Embed: a lookup table from integer indices to learned vectors (a one-hot InnerProduct)."""
from __future__ import annotations

from collections.abc import Sequence

from cct.blob import Blob
from cct.device import get_array_module
from cct.errors import CctError, ParamError
from cct.fillers import fill
from cct.layers.base import Layer
from cct.layers.inner_product import check_param_blob
from cct.layers.registry import register


@register("Embed")
class EmbedLayer(Layer):
    """``y[..., :] = W[int(x[...]), :] + b``.

    Bottom: indices of any shape (float values, truncated toward zero as Caffe's ``static_cast<int>``;
    each must lie in ``[0, input_dim)``).  Top: ``bottom.shape + (num_output,)``.
    Blobs: ``[weight (input_dim, num_output), bias (num_output,)]``.  Backward: ``dW[int(x)] += dy`` rows
    (repeated indices accumulate), ``db += Σ dy``; no gradient for the indices (an error if asked).
    Parameters (``embed_param``): ``input_dim``, ``num_output`` (both > 0), ``bias_term`` (true),
    ``weight_filler``, ``bias_filler`` (both default constant 0).
    """

    exact_num_bottom = 1
    exact_num_top = 1
    batch_separable = True

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.embed_param
        if p.num_output <= 0:
            raise ParamError("embed_param.num_output", f"EmbedLayer num_output must be positive "
                                                       f"(got {p.num_output})")
        if p.input_dim <= 0:
            raise ParamError("embed_param.input_dim", f"EmbedLayer input_dim must be positive "
                                                      f"(got {p.input_dim})")
        self.num_output, self.input_dim = int(p.num_output), int(p.input_dim)
        self.bias_term = bool(p.bias_term)
        n_blobs = 2 if self.bias_term else 1
        if self.blobs:
            if len(self.blobs) != n_blobs:
                raise ParamError("blobs", f"Embed with bias_term {str(self.bias_term).lower()} takes "
                                          f"{n_blobs} blob(s), the definition stores {len(self.blobs)}")
            check_param_blob(self.blobs[0], (self.input_dim, self.num_output), "blobs", "weight")
            if self.bias_term:
                check_param_blob(self.blobs[1], (self.num_output,), "blobs", "bias")
        else:
            weight = Blob((self.input_dim, self.num_output), xp=bottom[0].xp, dtype=bottom[0].dtype)
            fill(weight, p.weight_filler, "embed_param.weight_filler")
            self.blobs.append(weight)
            if self.bias_term:
                bias = Blob((self.num_output,), xp=bottom[0].xp, dtype=bottom[0].dtype)
                fill(bias, p.bias_filler, "embed_param.bias_filler")
                self.blobs.append(bias)
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        top[0].reshape(bottom[0].shape + (self.num_output,))

    def _indices(self, bottom: list[Blob]):
        """The bottom as flat int indices; trunc(x) lies in [0, K) iff -1 < x < K (NaN fails both)."""
        x = bottom[0].data.reshape(-1)
        xp = get_array_module(x)
        bad = ~((x > -1) & (x < self.input_dim))
        if bool(bad.any()):
            value = float(x[int(xp.argmax(bad))])
            raise CctError(f"layer '{self.name}' (Embed): input index {value:g} is out of range "
                           f"[0, {self.input_dim}) (embed_param.input_dim)")
        return x.astype("int64")

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        idx = self._indices(bottom)
        xp = get_array_module(idx)
        y = top[0].data.reshape(idx.size, self.num_output)
        xp.take(self.blobs[0].data, idx, axis=0, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        if propagate_down[0]:
            raise CctError(f"layer '{self.name}' (Embed): can't backpropagate to EmbedLayer input "
                           f"(set propagate_down: false)")
        dy = top[0].diff.reshape(-1, self.num_output)
        if self.param_propagate_down[0]:
            idx = self._indices(bottom)
            xp = get_array_module(idx)
            xp.add.at(self.blobs[0].diff, idx, dy)
        if self.bias_term and self.param_propagate_down[1]:
            b_diff = self.blobs[1].diff
            b_diff += dy.sum(axis=0)
