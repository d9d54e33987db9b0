"""Input and Parameter: layers with no bottoms that hold the net's inputs or a free learned blob."""
from __future__ import annotations

from collections.abc import Sequence

from cct.blob import Blob
from cct.errors import ParamError
from cct.layers.base import Layer
from cct.layers.registry import register


@register("Input")
class InputLayer(Layer):
    """The net's inputs: no bottoms, one or more tops whose data the user fills.

    ``input_param.shape``: none (tops keep the shape they have; the user reshapes them), one (every top
    gets it) or one per top.  Forward and backward do nothing; ``reshape`` leaves the tops alone, so a
    user's ``blob.reshape`` followed by ``net.reshape()`` sticks.
    """

    exact_num_bottom = 0
    min_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        shapes = self.layer_param.input_param.shape
        if len(shapes) not in (0, 1, len(top)):
            raise ParamError("input_param.shape", f"Must specify 'shape' once, once per top blob, or not at "
                                                  f"all: {len(top)} tops vs. {len(shapes)} shapes")
        for i, t in enumerate(top):
            if shapes:
                t.reshape(tuple(shapes[0 if len(shapes) == 1 else i].dim))

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        pass


@register("Parameter")
class ParameterLayer(Layer):
    """A learned blob as a layer output: no bottoms, one top sharing the blob's data and diff.

    Blob: ``[blob]`` of shape ``parameter_param.shape``, zero-initialised (Caffe has no filler here; load
    weights or share them by name).  The top takes that shape and shares the blob's memory at setup and
    again at every forward (as Caffe, which shares at forward only; a later weight sharing that swaps the
    blob's memory is picked up), so gradients written into the top's diff land in the blob's diff.
    """

    exact_num_bottom = 0
    exact_num_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        shape = tuple(self.layer_param.parameter_param.shape.dim)
        if not self.blobs:
            self.blobs.append(Blob(shape))
        elif len(self.blobs) != 1:
            raise ParamError("blobs", f"Parameter takes 1 blob, the definition stores {len(self.blobs)}")
        top[0].reshape(shape)
        if self.blobs[0].count != top[0].count:
            raise ParamError("parameter_param.shape",
                             f"stored blob has shape {self.blobs[0].shape_string()}, "
                             f"parameter_param.shape is {top[0].shape_string()}")
        self.param_propagate_down = [True]
        self._share(top)

    def _share(self, top: list[Blob]) -> None:
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        pass

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        self._share(top)

    def backward(self, top: list[Blob], propagate_down: Sequence[bool], bottom: list[Blob]) -> None:
        pass
