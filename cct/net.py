"""Net: a DAG of layers built from a NetParameter exactly as Caffe's ``Net::Init`` builds it.

Construction order: upgrade (on read) → filter by NetState → insert Split layers → create, wire and set
up each layer (in-place tops, "(automatic)" loss tops, loss weights) → decide which layers need backward
(propagate_down, force_backward, what feeds a loss) → share parameters by ParamSpec name → net outputs
(blobs nobody consumed, in sorted-name order).  Passes are run by the net's executor
(:mod:`cct.exec`), which whoever builds the net gives it (:meth:`NetCore.set_executor`; the plain serial
loop when nobody does): the net knows nothing of devices, threads or schedules.

pycaffe's Python-side conveniences (``forward(**inputs)``, ``forward_all`` …) live in
:mod:`cct.pycaffe` and are mixed into the public :class:`cct.Net`.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from cct import log
from cct.blob import Blob, blob_to_proto, proto_shape, shape_equals_legacy
from cct.errors import CctError
from cct.exec.base import Executor
from cct.exec.diff_memory import DiffSharing, share_diff_memory
from cct.exec.serial import SerialExecutor
from cct.graph import GraphError, filter_net, insert_splits
from cct.layers.base import Layer
from cct.layers.registry import create_layer
from cct.proto import caffe_pb2 as pb


class NetCore:
    """Caffe's ``Net``: layers, blobs, parameters; passes run by an injected executor."""

    executor: Executor

    # ---- construction --------------------------------------------------------------------------
    def _init_net(self, param: pb.NetParameter, source: str = "<net>", executor: Executor | None = None) -> None:
        """Build the net from ``param``; ``executor`` runs its passes (default: the plain serial loop).  The
        engines its layers measure to choose (autotuning) share one bounded budget, logged with its total; a net
        that runs no backward — TEST phase without ``force_backward``: ``cct test``, a solver's test nets, a
        deploy net in pycaffe — chooses each convolution by its forward time (its backward still runs if asked
        for, on the engine chosen)."""
        from cct.engines.autotune import measuring_session
        from cct.engines.base import choosing_for_forward_only
        from cct.engines.choice import engines_for

        # layers run on a device (GPU mode) choose their engines for it, measuring nothing on the host
        device_xp = executor.layer_array_module() if executor is not None else None
        inference = param.state.phase == pb.TEST and not param.force_backward
        with measuring_session() as ledger, engines_for(device_xp), choosing_for_forward_only(inference):
            self._build(param, source, executor)
        if ledger.measured or ledger.skipped:
            log.info("Engine autotuning (%s): %d layer(s) measured in %.2f s%s; cached for the next runs",
                     ledger.mode, ledger.measured, ledger.spent,
                     f", {ledger.skipped} close call(s) left to the cost model after the {ledger.budget:g} s "
                     "budget" if ledger.skipped else "")

    def _build(self, param: pb.NetParameter, source: str, executor: Executor | None) -> None:
        self._source = source
        self.before_forward_hooks: list[Callable[[int], None]] = []
        self.after_forward_hooks: list[Callable[[int], None]] = []
        self.before_backward_hooks: list[Callable[[int], None]] = []
        self.after_backward_hooks: list[Callable[[int], None]] = []
        self.phase = param.state.phase
        try:
            filtered = filter_net(param)
            log.info("Initializing net from parameters: \n%s", _debug_string(filtered))
            net_param = insert_splits(filtered)
        except GraphError as e:
            self._fail(e.layer, e.message)
        self.name = net_param.name
        self.debug_info = net_param.debug_info
        self._net_param = net_param

        self.layers: list[Layer] = []
        self._layer_names: list[str] = []
        self._blobs: list[Blob] = []
        self._blob_names: list[str] = []
        self._blob_need_backward: list[bool] = []
        self._bottom_vecs: list[list[Blob]] = []
        self._bottom_id_vecs: list[list[int]] = []
        self._top_vecs: list[list[Blob]] = []
        self._top_id_vecs: list[list[int]] = []
        self._bottom_need_backward: list[list[bool]] = []
        self._layer_need_backward: list[bool] = []
        self._param_id_vecs: list[list[int]] = []
        self._params: list[Blob] = []
        self._param_owners: list[int] = []
        self._param_display_names: list[str] = []
        self._param_layer_indices: list[tuple[int, int]] = []
        self._param_names_index: dict[str, int] = {}
        self.learnable_params: list[Blob] = []
        self._learnable_param_ids: list[int] = []
        self.params_lr: list[float] = []
        self.params_weight_decay: list[float] = []
        self._has_params_lr: list[bool] = []
        self._has_params_decay: list[bool] = []
        self._blob_loss_weights: list[float] = []
        self._input_blob_indices: list[int] = []
        blob_name_to_idx: dict[str, int] = {}
        available: set[str] = set()
        memory_used = 0

        for layer_id, lp in enumerate(net_param.layer):
            if not lp.HasField("phase"):
                lp.phase = self.phase
            layer_copy = pb.LayerParameter()
            layer_copy.CopyFrom(lp)
            if lp.propagate_down and len(lp.propagate_down) != len(lp.bottom):
                self._fail(lp, "propagate_down param must be specified either 0 or bottom_size times")
            try:
                layer = create_layer(layer_copy)
            except CctError as e:
                self._fail(lp, str(e))
            self.layers.append(layer)
            self._layer_names.append(lp.name)
            log.info("Creating Layer %s", lp.name)
            self._bottom_vecs.append([])
            self._bottom_id_vecs.append([])
            self._top_vecs.append([])
            self._top_id_vecs.append([])
            self._bottom_need_backward.append([])
            self._param_id_vecs.append([])
            need_backward = False
            for bottom_id, name in enumerate(lp.bottom):
                if name not in available:
                    self._fail(lp, f"Unknown bottom blob '{name}' (layer '{lp.name}', bottom index {bottom_id})")
                blob_id = blob_name_to_idx[name]
                log.info("%s <- %s", lp.name, name)
                self._bottom_vecs[layer_id].append(self._blobs[blob_id])
                self._bottom_id_vecs[layer_id].append(blob_id)
                available.discard(name)
                bnb = self._blob_need_backward[blob_id]
                if lp.propagate_down:
                    bnb = lp.propagate_down[bottom_id]
                self._bottom_need_backward[layer_id].append(bool(bnb))
                need_backward |= self._blob_need_backward[blob_id]
            for top_id, name in enumerate(lp.top):
                self._append_top(lp, layer_id, top_id, name, blob_name_to_idx, available)
                if lp.type == "Input":
                    self._input_blob_indices.append(blob_name_to_idx[name])
            if layer.auto_top_blobs:
                for top_id in range(len(lp.top), layer.min_top_blobs()):
                    self._append_top(lp, layer_id, top_id, None, None, None)
            log.info("Setting up %s", lp.name)
            try:
                layer.setup_layer(self._bottom_vecs[layer_id], self._top_vecs[layer_id])
            except CctError as e:
                self._fail(lp, str(e))
            except MemoryError as e:
                self._fail(lp, f"out of memory setting up the layer ({e})")
            for top_id, top in enumerate(self._top_vecs[layer_id]):
                blob_id = self._top_id_vecs[layer_id][top_id]
                if len(self._blob_loss_weights) <= blob_id:
                    self._blob_loss_weights.extend([0.0] * (blob_id + 1 - len(self._blob_loss_weights)))
                self._blob_loss_weights[blob_id] = layer.loss(top_id)
                log.info("Top shape: %s", top.shape_string())
                if layer.loss(top_id):
                    log.info("    with loss weight %s", log.fmt(layer.loss(top_id)))
                memory_used += top.count
            log.info("Memory required for data: %d", memory_used * 4)
            for param_id in range(len(layer.blobs)):
                spec = lp.param[param_id] if param_id < len(lp.param) else pb.ParamSpec()
                param_need_backward = spec.lr_mult != 0
                need_backward |= param_need_backward
                _set_param_propagate_down(layer, param_id, param_need_backward)
            for param_id in range(len(layer.blobs)):
                self._append_param(lp, layer_id, param_id)
            self._layer_need_backward.append(bool(need_backward))
            if need_backward:
                for blob_id in self._top_id_vecs[layer_id]:
                    self._blob_need_backward[blob_id] = True

        self._decide_backward(net_param)
        self._output_blob_indices = [blob_name_to_idx[n] for n in sorted(available)]
        for n in sorted(available):
            log.info("This network produces output %s", n)
        self._blob_name_to_idx = blob_name_to_idx
        self._share_weights()
        self.set_executor(executor if executor is not None else SerialExecutor())
        log.info("Network initialization done.")

    def set_executor(self, executor: Executor) -> None:
        """Run this net's passes with ``executor`` (an executor serves one net)."""
        executor.attach(self)
        self.executor = executor

    def _fail(self, lp: pb.LayerParameter, message: str):
        from cct.io.prototxt import find_layer_line

        where = self._source
        line = None
        if os.path.isfile(self._source):
            try:
                line = find_layer_line(self._source, lp.name)
            except Exception:  # noqa: BLE001 - locating the line is best effort
                line = None
        if line:
            where = f"{where}:{line}"
        raise CctError(f"{where}: layer '{lp.name}' ({lp.type}): {message}") from None

    def _append_top(self, lp, layer_id, top_id, name, blob_name_to_idx, available) -> None:
        if name is not None and layer_id < len(self.layers) and top_id < len(lp.bottom) \
                and lp.bottom[top_id] == name:
            log.info("%s -> %s (in-place)", lp.name, name)
            blob_id = blob_name_to_idx[name]
            self._top_vecs[layer_id].append(self._blobs[blob_id])
            self._top_id_vecs[layer_id].append(blob_id)
            available.add(name)
            return
        if name is not None and name in blob_name_to_idx:
            self._fail(lp, f"Top blob '{name}' produced by multiple sources.")
        blob_name = name if name is not None else "(automatic)"
        log.info("%s -> %s", lp.name, blob_name)
        blob = Blob()
        blob_id = len(self._blobs)
        self._blobs.append(blob)
        self._blob_names.append(blob_name)
        self._blob_need_backward.append(False)
        if blob_name_to_idx is not None:
            blob_name_to_idx[blob_name] = blob_id
        self._top_id_vecs[layer_id].append(blob_id)
        self._top_vecs[layer_id].append(blob)
        if available is not None:
            available.add(blob_name)

    def _append_param(self, lp: pb.LayerParameter, layer_id: int, param_id: int) -> None:
        layer = self.layers[layer_id]
        spec = lp.param[param_id] if param_id < len(lp.param) else pb.ParamSpec()
        param_name = spec.name
        net_param_id = len(self._params)
        self._params.append(layer.blobs[param_id])
        self._param_id_vecs[layer_id].append(net_param_id)
        self._param_layer_indices.append((layer_id, param_id))
        self._param_display_names.append(param_name or str(param_id))
        if not param_name or param_name not in self._param_names_index:
            self._param_owners.append(-1)
            if param_name:
                self._param_names_index[param_name] = net_param_id
            self._learnable_param_ids.append(len(self.learnable_params))
            self.learnable_params.append(layer.blobs[param_id])
            self._has_params_lr.append(spec.HasField("lr_mult"))
            self._has_params_decay.append(spec.HasField("decay_mult"))
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            return
        owner_id = self._param_names_index[param_name]
        self._param_owners.append(owner_id)
        owner_layer, owner_param = self._param_layer_indices[owner_id]
        log.info("Sharing parameters '%s' owned by layer '%s', param index %d", param_name,
                 self._layer_names[owner_layer], owner_param)
        this_blob = layer.blobs[param_id]
        owner_blob = self.layers[owner_layer].blobs[owner_param]
        if spec.share_mode == pb.ParamSpec.PERMISSIVE:
            if this_blob.count != owner_blob.count:
                self._fail(lp, f"Cannot share param '{param_name}' owned by layer "
                               f"'{self._layer_names[owner_layer]}' with layer '{lp.name}'; count mismatch. "
                               f"Owner layer param shape is {owner_blob.shape_string()}; sharing layer "
                               f"shape is {this_blob.shape_string()}")
        elif this_blob.shape != owner_blob.shape:
            self._fail(lp, f"Cannot share param '{param_name}' owned by layer "
                           f"'{self._layer_names[owner_layer]}' with layer '{lp.name}'; shape mismatch. "
                           f"Owner layer param shape is {owner_blob.shape_string()}; sharing layer "
                           f"expects shape {this_blob.shape_string()}")
        learnable_id = self._learnable_param_ids[owner_id]
        self._learnable_param_ids.append(learnable_id)
        if spec.HasField("lr_mult"):
            if self._has_params_lr[learnable_id]:
                if spec.lr_mult != self.params_lr[learnable_id]:
                    self._fail(lp, f"Shared param '{param_name}' has mismatched lr_mult.")
            else:
                self._has_params_lr[learnable_id] = True
                self.params_lr[learnable_id] = spec.lr_mult
        if spec.HasField("decay_mult"):
            if self._has_params_decay[learnable_id]:
                if spec.decay_mult != self.params_weight_decay[learnable_id]:
                    self._fail(lp, f"Shared param '{param_name}' has mismatched decay_mult.")
            else:
                self._has_params_decay[learnable_id] = True
                self.params_weight_decay[learnable_id] = spec.decay_mult

    def _share_weights(self) -> None:
        for i, owner in enumerate(self._param_owners):
            if owner >= 0:
                self._params[i].share_data(self._params[owner])
                self._params[i].share_diff(self._params[owner])

    def _decide_backward(self, net_param: pb.NetParameter) -> None:
        """Caffe's reverse pass: a layer needs backward only if it leads to a loss and something below
        it wants a gradient; then ``force_backward`` overrides."""
        under_loss: set[str] = set()
        skip_backp: set[str] = set()
        for layer_id in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[layer_id]
            contributes = False
            skip_propagate = True
            for top_id, blob_id in enumerate(self._top_id_vecs[layer_id]):
                name = self._blob_names[blob_id]
                if layer.loss(top_id) or name in under_loss:
                    contributes = True
                if name not in skip_backp:
                    skip_propagate = False
                if contributes and not skip_propagate:
                    break
            if self._layer_need_backward[layer_id] and skip_propagate:
                self._layer_need_backward[layer_id] = False
                self._bottom_need_backward[layer_id] = [False] * len(self._bottom_need_backward[layer_id])
            if not contributes:
                self._layer_need_backward[layer_id] = False
            if self._layer_need_backward[layer_id]:
                log.info("%s needs backward computation.", self._layer_names[layer_id])
            else:
                log.info("%s does not need backward computation.", self._layer_names[layer_id])
            for bottom_id, blob_id in enumerate(self._bottom_id_vecs[layer_id]):
                name = self._blob_names[blob_id]
                if contributes:
                    under_loss.add(name)
                else:
                    self._bottom_need_backward[layer_id][bottom_id] = False
                if not self._bottom_need_backward[layer_id][bottom_id]:
                    skip_backp.add(name)
        if net_param.force_backward:
            for layer_id, layer in enumerate(self.layers):
                self._layer_need_backward[layer_id] = True
                for bottom_id, blob_id in enumerate(self._bottom_id_vecs[layer_id]):
                    nb = self._bottom_need_backward[layer_id][bottom_id] or layer.allow_force_backward(bottom_id)
                    self._bottom_need_backward[layer_id][bottom_id] = nb
                    self._blob_need_backward[blob_id] = self._blob_need_backward[blob_id] or nb
                for param_id in range(len(layer.blobs)):
                    _set_param_propagate_down(layer, param_id, True)

    # ---- forward / backward ----------------------------------------------------------------------
    def forward_from_to(self, start: int, end: int) -> float:
        """Run layers ``start..end`` (inclusive); return the summed weighted loss."""
        if not (0 <= start and end < len(self.layers)):
            raise CctError(f"forward range {start}..{end} outside 0..{len(self.layers) - 1}")
        try:
            return self.executor.forward(self, start, end)
        except CctError as e:
            raise CctError(self._in_context(str(e))) from None

    def backward_from_to(self, start: int, end: int) -> None:
        """Back-propagate through layers ``start`` down to ``end`` (inclusive, start >= end)."""
        if not (end >= 0 and start < len(self.layers)):
            raise CctError(f"backward range {start}..{end} outside 0..{len(self.layers) - 1}")
        try:
            self.executor.backward(self, start, end)
        except CctError as e:
            raise CctError(self._in_context(str(e))) from None

    def _in_context(self, message: str) -> str:
        """A pass's error with the net's file and, unless it names one already, where its data comes from
        (a bad label in a record is found by the loss layer, far from the file that holds it)."""
        if message.startswith(self._source):
            return message
        sources = [s for s in self._data_sources() if s]
        if sources and not any(s in message for s in sources):
            message += f" (the net's data comes from {', '.join(sources)})"
        return f"{self._source}: {message}"

    def _data_sources(self) -> list[str]:
        found = []
        for layer in self.layers:
            lp = layer.layer_param
            for field in ("data_param", "image_data_param", "hdf5_data_param", "window_data_param"):
                if lp.HasField(field):
                    found.append(getattr(lp, field).source)
        return found

    def forward_prefilled(self) -> float:
        """Caffe's ``Net::Forward(&loss)``: all layers; returns the loss."""
        return self.forward_from_to(0, len(self.layers) - 1)

    def backward_all(self) -> None:
        self.backward_from_to(len(self.layers) - 1, 0)
        if self.debug_info:
            asum_data = sum(float(np.abs(p.data).sum()) for p in self.learnable_params)
            asum_diff = sum(float(np.abs(p.diff).sum()) for p in self.learnable_params)
            l2_data = sum(float((p.data.astype(np.float64) ** 2).sum()) for p in self.learnable_params)
            l2_diff = sum(float((p.diff.astype(np.float64) ** 2).sum()) for p in self.learnable_params)
            log.info("    [Backward] All net params (data, diff): L1 norm = (%s, %s); L2 norm = (%s, %s)",
                     log.fmt(asum_data), log.fmt(asum_diff), log.fmt(np.sqrt(l2_data)), log.fmt(np.sqrt(l2_diff)))

    def forward_backward(self) -> float:
        loss = self.forward_prefilled()
        self.backward_all()
        return loss

    def update(self) -> None:
        """``data -= diff`` for every learnable (owner) parameter."""
        for p in self.learnable_params:
            p.update()

    def clear_param_diffs(self) -> None:
        """Zero the diffs of all learnable parameters (shared copies share the memory), as the executor
        says (an executor applying updates lazily zeroes a parameter's diff after its update)."""
        self.executor.clear_param_diffs(self)

    def reshape(self) -> None:
        """Propagate input shapes through every layer's reshape."""
        for i, layer in enumerate(self.layers):
            try:
                layer.reshape(self._bottom_vecs[i], self._top_vecs[i])
            except CctError as e:
                name = self._layer_names[i]
                if f"'{name}'" in str(e):
                    raise
                raise CctError(f"layer '{name}' ({layer.type}): {e}") from None

    def share_diff_memory(self, every_layer: bool = False) -> DiffSharing:
        """cct's: let blobs whose gradients are never alive at once in a backward pass share their memory
        (what ``cct train`` and ``cct time`` run; afterwards a blob's ``diff`` is meaningful only during the
        pass that writes it — :mod:`cct.exec.diff_memory`).  ``every_layer``: every layer's backward runs, as
        in ``cct time``.  Returns what was shared."""
        return share_diff_memory(self, every_layer)

    # ---- weights -------------------------------------------------------------------------------
    def share_trained_layers_with(self, other: NetCore) -> None:
        """Share parameter memory with same-named layers of ``other`` (used before every test pass)."""
        by_name = {n: i for i, n in reversed(list(enumerate(self._layer_names)))}
        for i, source in enumerate(other.layers):
            name = other._layer_names[i]
            j = by_name.get(name)
            if j is None:
                log.info("Ignoring source layer %s", name)
                continue
            target = self.layers[j].blobs
            if len(target) != len(source.blobs):
                raise CctError(f"Incompatible number of blobs for layer {name}")
            for k, (t, s) in enumerate(zip(target, source.blobs)):
                if t.shape != s.shape:
                    raise CctError(f"Cannot share param {k} weights from layer '{name}'; shape mismatch. "
                                   f"Source param shape is {s.shape_string()}; target param shape is "
                                   f"{t.shape_string()}")
                t.share_data(s)

    def copy_trained_layers_from(self, source) -> None:
        """Copy weights by layer name from a .caffemodel path (binary or HDF5) or a NetParameter."""
        from cct.io import weights as wio

        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if wio.is_hdf5(path):
                self._copy_from_hdf5(path)
                return
            source = wio.read_caffemodel(path)
            label = path
        else:
            label = "<NetParameter>"
        by_name = {n: i for i, n in reversed(list(enumerate(self._layer_names)))}
        for src in source.layer:
            j = by_name.get(src.name)
            if j is None:
                log.info("Ignoring source layer %s", src.name)
                continue
            log.info("Copying source layer %s Type:%s #blobs=%d", src.name, src.type, len(src.blobs))
            target = self.layers[j].blobs
            if len(target) != len(src.blobs):
                raise CctError(f"{label}: Incompatible number of blobs for layer {src.name} "
                               f"(file has {len(src.blobs)}, net has {len(target)})")
            for k, (t, s) in enumerate(zip(target, src.blobs)):
                legacy = any(s.HasField(f) for f in ("num", "channels", "height", "width"))
                shape = proto_shape(s)
                ok = shape_equals_legacy(shape, t.shape) if legacy else tuple(shape) == t.shape
                if not ok:
                    src_str = "".join(f"{d} " for d in shape) + f"({int(np.prod(shape))})"
                    raise CctError(f"{label}: Cannot copy param {k} weights from layer '{src.name}'; shape "
                                   f"mismatch.  Source param shape is {src_str}; target param shape is "
                                   f"{t.shape_string()}. To learn this layer's parameters from scratch "
                                   f"rather than copying from a saved net, rename the layer.")
                from cct.blob import blob_from_proto

                blob_from_proto(s, t, reshape=False)

    def _copy_from_hdf5(self, path: str) -> None:
        from cct.io.hdf5 import read_hdf5_weights

        data = read_hdf5_weights(path)
        by_name = {n: i for i, n in reversed(list(enumerate(self._layer_names)))}
        for name, blobs in data.items():
            j = by_name.get(name)
            if j is None:
                log.info("Ignoring source layer %s", name)
                continue
            target = self.layers[j].blobs
            if len(blobs) > len(target):
                raise CctError(f"{path}: Incompatible number of blobs for layer {name}")
            for k, t in enumerate(target):
                if k not in blobs:
                    net_param_id = self._param_id_vecs[j][k]
                    if self._param_owners[net_param_id] == -1:
                        raise CctError(f"{path}: Incompatible number of blobs for layer {name}")
                    continue
                arr = blobs[k]
                if tuple(arr.shape) != t.shape:
                    raise CctError(f"{path}: Cannot copy param {k} weights from layer '{name}'; shape "
                                   f"mismatch. Source param shape is {tuple(arr.shape)}; target param shape "
                                   f"is {t.shape_string()}")
                t.data[...] = arr

    def to_proto(self, write_diff: bool = False) -> pb.NetParameter:
        """Caffe's ``Net::ToProto``: name + every layer's parameter with its blobs."""
        param = pb.NetParameter()
        param.name = self.name
        for layer in self.layers:
            lp = param.layer.add()
            lp.CopyFrom(layer.layer_param)
            del lp.blobs[:]
            for b in layer.blobs:
                blob_to_proto(b, lp.blobs.add(), write_diff)
        return param

    def to_hdf5(self, path: str, write_diff: bool = False) -> None:
        from cct.io.hdf5 import write_hdf5_weights

        layers, diffs = [], []
        for i, layer in enumerate(self.layers):
            owners = [self._param_owners[pid] == -1 for pid in self._param_id_vecs[i]]
            layers.append((self._layer_names[i], [np.asarray(b.data) if own else None
                                                  for b, own in zip(layer.blobs, owners)]))
            diffs.append((self._layer_names[i], [np.asarray(b.diff) for b in layer.blobs]))
        write_hdf5_weights(path, layers, diffs if write_diff else None)

    # ---- introspection -----------------------------------------------------------------------
    def has_blob(self, name: str) -> bool:
        return name in self._blob_name_to_idx

    def blob_by_name(self, name: str) -> Blob:
        if name not in self._blob_name_to_idx:
            raise CctError(f"Unknown blob name {name}")
        return self._blobs[self._blob_name_to_idx[name]]

    def has_layer(self, name: str) -> bool:
        return name in self._layer_names

    def layer_by_name(self, name: str) -> Layer:
        if name not in self._layer_names:
            raise CctError(f"Unknown layer name {name}")
        return self.layers[self._layer_names.index(name)]

    @property
    def output_blobs(self) -> list[Blob]:
        return [self._blobs[i] for i in self._output_blob_indices]

    @property
    def output_blob_names(self) -> list[str]:
        return [self._blob_names[i] for i in self._output_blob_indices]

    @property
    def output_loss_weights(self) -> list[float]:
        return [self._blob_loss_weights[i] for i in self._output_blob_indices]

    def param_layers(self) -> list[list[int]]:
        """For each learnable parameter (``learnable_params`` order), the indices of the layers that use it
        (its owner first; more than one when layers share it by name): its diff is complete once the
        backward pass has gone below the smallest."""
        used: list[list[int]] = [[] for _ in self.learnable_params]
        for i, ids in enumerate(self._param_id_vecs):
            for net_param_id in ids:
                used[self._learnable_param_ids[net_param_id]].append(i)
        return used

    @property
    def layer_need_backward(self) -> list[bool]:
        return self._layer_need_backward

    @property
    def bottom_need_backward(self) -> list[list[bool]]:
        return self._bottom_need_backward

    @property
    def bottom_vecs(self) -> list[list[Blob]]:
        return self._bottom_vecs

    @property
    def top_vecs(self) -> list[list[Blob]]:
        return self._top_vecs

    # ---- debug info (Caffe's debug_info: true) -----------------------------------------------------
    def forward_debug_info(self, i: int) -> None:
        """Caffe's ``[Forward]`` debug lines of layer ``i`` (executors call it when ``debug_info`` is on)."""
        for top_id, blob in zip(self._top_id_vecs[i], self._top_vecs[i]):
            log.info("    [Forward] Layer %s, top blob %s data: %s", self._layer_names[i],
                     self._blob_names[top_id], log.fmt(_mean_abs(blob.data)))
        for k, pid in enumerate(self._param_id_vecs[i]):
            log.info("    [Forward] Layer %s, param blob %d data: %s", self._layer_names[i], k,
                     log.fmt(_mean_abs(self._params[pid].data)))

    def backward_debug_info(self, i: int) -> None:
        """Caffe's ``[Backward]`` debug lines of layer ``i``."""
        for b, (blob_id, blob) in enumerate(zip(self._bottom_id_vecs[i], self._bottom_vecs[i])):
            if self._bottom_need_backward[i][b]:
                log.info("    [Backward] Layer %s, bottom blob %s diff: %s", self._layer_names[i],
                         self._blob_names[blob_id], log.fmt(_mean_abs(blob.diff)))
        for k, pid in enumerate(self._param_id_vecs[i]):
            if _param_propagate_down(self.layers[i], k):
                log.info("    [Backward] Layer %s, param blob %d diff: %s", self._layer_names[i], k,
                         log.fmt(_mean_abs(self._params[pid].diff)))


def _mean_abs(a) -> float:
    return float(np.abs(a).sum(dtype=np.float64) / max(a.size, 1))


def _set_param_propagate_down(layer: Layer, param_id: int, value: bool) -> None:
    ppd = layer.param_propagate_down
    if len(ppd) <= param_id:
        ppd.extend([True] * (param_id + 1 - len(ppd)))
    ppd[param_id] = value


def _param_propagate_down(layer: Layer, param_id: int) -> bool:
    ppd = layer.param_propagate_down
    return ppd[param_id] if param_id < len(ppd) else True


def _debug_string(param: pb.NetParameter) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(param)


def net_state(phase: int | None, level: int = 0, stages: Sequence[str] | None = None,
              base: pb.NetState | None = None) -> pb.NetState:
    """A NetState: ``base`` (the file's state) with phase/level set and ``stages`` appended."""
    state = pb.NetState()
    if base is not None:
        state.CopyFrom(base)
    if phase is not None:
        state.phase = phase
    state.level = level
    state.stage.extend(stages or [])
    return state


def blob_dict(names: Sequence[str], blobs: Sequence[Blob]) -> OrderedDict:
    return OrderedDict(zip(names, blobs))
