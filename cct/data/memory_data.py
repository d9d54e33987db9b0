"""``MemoryData`` and ``DummyData``: data layers without files.

MemoryData serves arrays handed to :meth:`MemoryDataLayer.reset` (pycaffe's
``net.set_input_arrays(data, labels)``), ``batch_size`` items per forward, cycling; no transformation
is applied.  Tops ``data`` ``(B, C, H, W)`` and ``label`` — ``(B,)`` after setup, ``(B, 1, 1, 1)``
after a forward, as in Caffe.

DummyData fills its tops with fillers: shapes from ``shape`` (one, or one per top) or the legacy
``num/channels/height/width`` (each one, or one per top); ``data_filler`` absent (constant 0), one
for all tops, or one per top.  Tops with a ``constant`` filler are filled once at setup, the others
refilled on every forward.
"""
from __future__ import annotations

import numpy as np

from cct import log
from cct.blob import Blob
from cct.errors import CctError, ParamError
from cct.fillers import constant_filler, fill
from cct.layers.base import Layer
from cct.layers.registry import register
from cct.proto import caffe_pb2 as pb


@register("MemoryData")
class MemoryDataLayer(Layer):
    """Caffe's ``MemoryData``: batches cut from in-memory arrays given to :meth:`reset`."""

    exact_num_bottom = 0
    exact_num_top = 2

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.memory_data_param
        self.batch_size, self.channels = int(p.batch_size), int(p.channels)
        self.height, self.width = int(p.height), int(p.width)
        if self.batch_size * self.channels * self.height * self.width <= 0:
            raise ParamError("memory_data_param", "batch_size, channels, height, and width must be specified "
                                                  "and positive in memory_data_param")
        self._data: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self._n = 0
        self._pos = 0
        top[0].reshape(self.batch_size, self.channels, self.height, self.width)
        top[1].reshape(self.batch_size)

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Nothing: :meth:`forward` sets the shapes."""

    def reset(self, data: np.ndarray, labels: np.ndarray) -> None:
        """Serve ``data`` ``(n, C, H, W)`` float32 and ``labels`` (``n`` values) from the next forward on.

        ``n`` must be a multiple of ``batch_size``.  The arrays are kept, not copied (as Caffe keeps the
        pointers), so later changes to them show in later forwards."""
        data = np.ascontiguousarray(data, dtype=np.float32)
        labels = np.ascontiguousarray(labels, dtype=np.float32)
        chw = (self.channels, self.height, self.width)
        if data.ndim != 4 or data.shape[1:] != chw:
            raise CctError(f"layer '{self.name}' (MemoryData): data array must have shape (n, "
                           f"{', '.join(map(str, chw))}); got {data.shape}")
        n = data.shape[0]
        labels = labels.reshape(labels.shape[0], -1) if labels.ndim else labels.reshape(1, 1)
        if labels.shape != (n, 1):
            raise CctError(f"layer '{self.name}' (MemoryData): labels must hold one value per item "
                           f"({n}); got shape {labels.shape}")
        if n == 0 or n % self.batch_size != 0:
            raise CctError(f"layer '{self.name}' (MemoryData): n must be a multiple of batch size "
                           f"(n = {n}, batch_size = {self.batch_size})")
        if self.layer_param.HasField("transform_param"):
            log.warning("%s does not transform array data on Reset()", self.type)
        self._data = data
        self._labels = labels.reshape(n)
        self._n = n
        self._pos = 0

    def set_batch_size(self, new_size: int) -> None:
        self.batch_size = int(new_size)

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        if self._data is None:
            raise CctError(f"layer '{self.name}' (MemoryData) needs to be initialized by calling reset "
                           "(pycaffe: net.set_input_arrays(data, labels))")
        b, pos = self.batch_size, self._pos
        top[0].reshape(b, self.channels, self.height, self.width)
        top[1].reshape(b, 1, 1, 1)
        top[0].data[...] = top[0].xp.asarray(self._data[pos:pos + b])
        top[1].data[...] = top[1].xp.asarray(self._labels[pos:pos + b].reshape(b, 1, 1, 1))
        self._pos = (pos + b) % self._n


@register("DummyData")
class DummyDataLayer(Layer):
    """Caffe's ``DummyData``: tops filled by fillers."""

    exact_num_bottom = 0
    min_top = 1

    def setup(self, bottom: list[Blob], top: list[Blob]) -> None:
        p = self.layer_param.dummy_data_param
        num_top = len(top)
        nf = len(p.data_filler)
        if nf not in (0, 1, num_top):
            raise ParamError("dummy_data_param.data_filler",
                             f"Number of data fillers must be 0, 1 or equal to the number of tops: "
                             f"{num_top}; you specified {nf} data fillers.")
        legacy = bool(len(p.num) or len(p.channels) or len(p.height) or len(p.width))
        shapes: list[tuple[int, ...]] = []
        if legacy:
            if len(p.shape):
                raise ParamError("dummy_data_param.shape", "Both shape and legacy fields were specified")
            dims = {}
            for name in ("num", "channels", "height", "width"):
                values = list(getattr(p, name))
                if len(values) not in (1, num_top):
                    raise ParamError(f"dummy_data_param.{name}",
                                     f"Must specify '{name}' once, or once per top blob ({num_top}); "
                                     f"specified {len(values)}.")
                dims[name] = values
            for i in range(num_top):
                shapes.append(tuple(int(v[0] if len(v) == 1 else v[i]) for v in dims.values()))
        else:
            if len(p.shape) not in (1, num_top):
                raise ParamError("dummy_data_param.shape", f"Must specify 'shape' once, or once per top blob "
                                                           f"({num_top}); specified {len(p.shape)}.")
            for i in range(num_top):
                shapes.append(tuple(int(d) for d in p.shape[0 if len(p.shape) == 1 else i].dim))
        self.fillers: list[pb.FillerParameter] = (
            [constant_filler(0.0)] if nf == 0 else list(p.data_filler))
        for t, shape in zip(top, shapes):
            t.reshape(shape)
        # Constant tops are filled now and never again; the others on every forward.
        self.refill = [f.type != "constant" for f in self.fillers]
        for i, t in enumerate(top):
            fid = i if len(self.fillers) > 1 else 0
            if not self.refill[fid]:
                fill(t, self.fillers[fid], f"dummy_data_param.data_filler[{fid}]")

    def reshape(self, bottom: list[Blob], top: list[Blob]) -> None:
        """Nothing: the shapes are fixed at setup."""

    def forward(self, bottom: list[Blob], top: list[Blob]) -> None:
        for i, t in enumerate(top):
            fid = i if len(self.fillers) > 1 else 0
            if self.refill[fid]:
                fill(t, self.fillers[fid], f"dummy_data_param.data_filler[{fid}]")
