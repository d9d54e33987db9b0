"""Upgrading deprecated net and solver definitions, as Caffe's ``util/upgrade_proto.cpp``.

Every upgrade is a pair: ``*_needs_*`` says whether a message uses the old form, and the matching
``upgrade_*`` rewrites it **in place**.  The pairs are pure (no file access); ``source`` only names the
file in error messages.  :func:`upgrade_net_as_needed` applies the net pairs in Caffe's order and logs
Caffe's messages; it runs on every prototxt *and* every caffemodel that is read.  (Inline
``net_param`` in a solver is not upgraded, as in Caffe.)

Net history:

* **V0** (2013): ``layers { layer { name type ...flat fields... } bottom top }``; padding was a
  separate ``"padding"`` layer.
* **V1**: ``layers { name type: ENUM blobs_lr weight_decay *_param }``.
* **V2** (current): ``layer { name type: "String" param { lr_mult decay_mult } *_param }``.
* Net-level ``input``/``input_shape``/``input_dim`` became an ``Input`` layer; BatchNorm layers used to
  declare their three statistics blobs with ``param { lr_mult: 0 }`` by hand.

Where Caffe aborts (LOG(FATAL)/CHECK) these functions raise :class:`CctError`; where Caffe logs an
error and carries on, they log the same error and return ``False`` ("not fully compatible").
"""
from __future__ import annotations

from cct import log
from cct.errors import CctError
from cct.proto import caffe_pb2

NetParameter = caffe_pb2.NetParameter
V1 = caffe_pb2.V1LayerParameter
V0 = caffe_pb2.V0LayerParameter

# ------------------------------------------------------------------------------------------------
# V0 -> V1
# ------------------------------------------------------------------------------------------------

#: V0 type string -> V1 LayerType enum name.  Anything else is rejected.
V0_TYPE_TO_V1: dict[str, str] = {
    "accuracy": "ACCURACY",
    "bnll": "BNLL",
    "concat": "CONCAT",
    "conv": "CONVOLUTION",
    "data": "DATA",
    "dropout": "DROPOUT",
    "euclidean_loss": "EUCLIDEAN_LOSS",
    "flatten": "FLATTEN",
    "hdf5_data": "HDF5_DATA",
    "hdf5_output": "HDF5_OUTPUT",
    "im2col": "IM2COL",
    "images": "IMAGE_DATA",
    "infogain_loss": "INFOGAIN_LOSS",
    "innerproduct": "INNER_PRODUCT",
    "lrn": "LRN",
    "multinomial_logistic_loss": "MULTINOMIAL_LOGISTIC_LOSS",
    "pool": "POOLING",
    "relu": "RELU",
    "sigmoid": "SIGMOID",
    "softmax": "SOFTMAX",
    "softmax_loss": "SOFTMAX_LOSS",
    "split": "SPLIT",
    "tanh": "TANH",
    "window_data": "WINDOW_DATA",
}

# V0 field -> {V0 type: (V1 sub-message, field, how)}; how is "set" (scalar), "add" (repeated) or
# "copy" (sub-message).  A V0 field set on a type that is not listed is logged and dropped.
_V0_FIELD_MAP: dict[str, dict[str, tuple[str, str, str]]] = {
    "num_output": {"conv": ("convolution_param", "num_output", "set"),
                   "innerproduct": ("inner_product_param", "num_output", "set")},
    "biasterm": {"conv": ("convolution_param", "bias_term", "set"),
                 "innerproduct": ("inner_product_param", "bias_term", "set")},
    "weight_filler": {"conv": ("convolution_param", "weight_filler", "copy"),
                      "innerproduct": ("inner_product_param", "weight_filler", "copy")},
    "bias_filler": {"conv": ("convolution_param", "bias_filler", "copy"),
                    "innerproduct": ("inner_product_param", "bias_filler", "copy")},
    "pad": {"conv": ("convolution_param", "pad", "add"), "pool": ("pooling_param", "pad", "set")},
    "kernelsize": {"conv": ("convolution_param", "kernel_size", "add"),
                   "pool": ("pooling_param", "kernel_size", "set")},
    "group": {"conv": ("convolution_param", "group", "set")},
    "stride": {"conv": ("convolution_param", "stride", "add"),
               "pool": ("pooling_param", "stride", "set")},
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio", "set")},
    "local_size": {"lrn": ("lrn_param", "local_size", "set")},
    "alpha": {"lrn": ("lrn_param", "alpha", "set")},
    "beta": {"lrn": ("lrn_param", "beta", "set")},
    "k": {"lrn": ("lrn_param", "k", "set")},
    "source": {"data": ("data_param", "source", "set"),
               "hdf5_data": ("hdf5_data_param", "source", "set"),
               "images": ("image_data_param", "source", "set"),
               "window_data": ("window_data_param", "source", "set"),
               "infogain_loss": ("infogain_loss_param", "source", "set")},
    "batchsize": {"data": ("data_param", "batch_size", "set"),
                  "hdf5_data": ("hdf5_data_param", "batch_size", "set"),
                  "images": ("image_data_param", "batch_size", "set"),
                  "window_data": ("window_data_param", "batch_size", "set")},
    "rand_skip": {"data": ("data_param", "rand_skip", "set"),
                  "images": ("image_data_param", "rand_skip", "set")},
    "shuffle_images": {"images": ("image_data_param", "shuffle", "set")},
    "new_height": {"images": ("image_data_param", "new_height", "set")},
    "new_width": {"images": ("image_data_param", "new_width", "set")},
    "concat_dim": {"concat": ("concat_param", "concat_dim", "set")},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold", "set")},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold", "set")},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction", "set")},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad", "set")},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode", "set")},
    "hdf5_output_param": {"hdf5_output": ("hdf5_output_param", "", "copy")},
}

# V0 fields that go to transform_param whatever the layer type.
_V0_TRANSFORM_FIELDS = {"scale": "scale", "meanfile": "mean_file", "cropsize": "crop_size",
                        "mirror": "mirror"}

# The name Caffe's error message uses for a misplaced V0 field (it says "shuffle", not the field name).
_V0_FIELD_LABEL = {"shuffle_images": "shuffle"}


def net_needs_v0_to_v1_upgrade(net: NetParameter) -> bool:
    """True iff some ``layers`` entry holds a nested V0 ``layer`` message."""
    return any(l.HasField("layer") for l in net.layers)


def upgrade_v0_padding_layers(net: NetParameter, source: str = "<net>") -> None:
    """Fold V0 ``"padding"`` layers into the conv/pool layer that consumes them (in place).

    Each padding layer is dropped; a layer reading its output must be ``conv`` or ``pool`` with one
    bottom, gets the padding layer's ``pad`` and reads the padding layer's own input instead.
    """
    old = list(net.layers)
    producer: dict[str, int] = {name: -1 for name in net.input}  # blob -> index of last producer
    kept: list[V1] = []
    for i, conn in enumerate(old):
        v0 = conn.layer
        new = None
        if v0.type != "padding":
            new = V1()
            new.CopyFrom(conn)
            kept.append(new)
        for j, blob in enumerate(conn.bottom):
            if blob not in producer:
                raise CctError(f"{source}: layer '{v0.name}': unknown bottom blob '{blob}' "
                               "(while folding V0 padding layers)")
            src_idx = producer[blob]
            if src_idx < 0 or old[src_idx].layer.type != "padding":
                continue
            pad_layer = old[src_idx]
            if v0.type not in ("conv", "pool"):
                raise CctError(f"{source}: layer '{v0.name}': a V0 padding layer feeds a layer of type "
                               f"'{v0.type}'; only conv and pool layers can take padding")
            if len(conn.bottom) != 1:
                raise CctError(f"{source}: layer '{v0.name}': a layer fed by a V0 padding layer must "
                               f"have exactly one bottom, not {len(conn.bottom)}")
            if len(pad_layer.bottom) != 1 or len(pad_layer.top) != 1:
                raise CctError(f"{source}: layer '{pad_layer.layer.name}': a V0 padding layer must "
                               "have exactly one bottom and one top")
            assert new is not None
            new.layer.pad = pad_layer.layer.pad
            new.bottom[j] = pad_layer.bottom[0]
        for blob in conn.top:
            producer[blob] = i
    del net.layers[:]
    net.layers.extend(kept)


def upgrade_v0_layer(v0_conn: V1, source: str = "<net>") -> tuple[V1, bool]:
    """One V0 layer (a V1 ``layers`` entry holding a V0 ``layer``) as a V1 layer.

    Returns ``(v1_layer, fully_compatible)``; a field that does not apply to the layer's type is
    logged ("Unknown parameter X for layer type Y") and dropped.
    """
    out = V1()
    out.bottom.extend(v0_conn.bottom)
    out.top.extend(v0_conn.top)
    ok = True
    if not v0_conn.HasField("layer"):
        return out, ok
    v0 = v0_conn.layer
    t = v0.type
    if v0.HasField("name"):
        out.name = v0.name
    if v0.HasField("type"):
        if t not in V0_TYPE_TO_V1:
            raise CctError(f"{source}: layer '{v0.name}': unknown V0 layer type '{t}' "
                           f"(known: {', '.join(sorted(V0_TYPE_TO_V1))})")
        out.type = V1.LayerType.Value(V0_TYPE_TO_V1[t])
    out.blobs.extend(v0.blobs)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    for field, targets in _V0_FIELD_MAP.items():
        if not v0.HasField(field):
            continue
        if t not in targets:
            log.error(f"Unknown parameter {_V0_FIELD_LABEL.get(field, field)} for layer type {t}")
            ok = False
            continue
        sub_name, dst, how = targets[t]
        sub = getattr(out, sub_name)
        value = getattr(v0, field)
        if how == "set":
            setattr(sub, dst, value)
        elif how == "add":
            getattr(sub, dst).append(value)
        elif dst:
            getattr(sub, dst).CopyFrom(value)
        else:
            sub.CopyFrom(value)
    if v0.HasField("pool"):
        if t == "pool":
            # V0 and current PoolMethod share names and numbers (MAX, AVE, STOCHASTIC).
            out.pooling_param.pool = caffe_pb2.PoolingParameter.PoolMethod.Value(
                V0.PoolMethod.Name(v0.pool))
        else:
            log.error(f"Unknown parameter pool for layer type {t}")
            ok = False
    for field, dst in _V0_TRANSFORM_FIELDS.items():
        if v0.HasField(field):
            setattr(out.transform_param, dst, getattr(v0, field))
    return out, ok


def upgrade_v0_net(net: NetParameter, source: str = "<net>") -> bool:
    """V0 -> V1 (in place): fold padding layers, then convert each layer.

    Only ``name``, ``layers``, ``input``, ``input_dim`` and ``force_backward`` survive at net level,
    as in Caffe.  Returns False if some field could not be placed (see :func:`upgrade_v0_layer`).
    """
    padded = NetParameter()
    padded.CopyFrom(net)
    upgrade_v0_padding_layers(padded, source)
    net.Clear()
    if padded.HasField("name"):
        net.name = padded.name
    ok = True
    for conn in padded.layers:
        layer, layer_ok = upgrade_v0_layer(conn, source)
        net.layers.append(layer)
        ok &= layer_ok
    net.input.extend(padded.input)
    net.input_dim.extend(padded.input_dim)
    if padded.HasField("force_backward"):
        net.force_backward = padded.force_backward
    return ok


# ------------------------------------------------------------------------------------------------
# Data transformation fields (V1 data layers) -> transform_param
# ------------------------------------------------------------------------------------------------

_DATA_PARAM_OF_TYPE = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param",
                       V1.WINDOW_DATA: "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def net_needs_data_upgrade(net: NetParameter) -> bool:
    """True iff a V1 DATA/IMAGE_DATA/WINDOW_DATA layer sets scale/mean_file/crop_size/mirror in its
    own parameter message instead of ``transform_param``."""
    for l in net.layers:
        sub = _DATA_PARAM_OF_TYPE.get(l.type)
        if sub and any(getattr(l, sub).HasField(f) for f in _TRANSFORM_FIELDS):
            return True
    return False


def upgrade_net_data_transformation(net: NetParameter) -> None:
    """Move those four fields into each layer's ``transform_param`` (in place)."""
    for l in net.layers:
        sub_name = _DATA_PARAM_OF_TYPE.get(l.type)
        if not sub_name:
            continue
        sub = getattr(l, sub_name)
        for f in _TRANSFORM_FIELDS:
            if sub.HasField(f):
                setattr(l.transform_param, f, getattr(sub, f))
                sub.ClearField(f)


# ------------------------------------------------------------------------------------------------
# V1 -> V2
# ------------------------------------------------------------------------------------------------

#: V1 LayerType enum name -> current ``type`` string.
V1_TYPE_TO_STRING: dict[str, str] = {
    "NONE": "",
    "ABSVAL": "AbsVal",
    "ACCURACY": "Accuracy",
    "ARGMAX": "ArgMax",
    "BNLL": "BNLL",
    "CONCAT": "Concat",
    "CONTRASTIVE_LOSS": "ContrastiveLoss",
    "CONVOLUTION": "Convolution",
    "DECONVOLUTION": "Deconvolution",
    "DATA": "Data",
    "DROPOUT": "Dropout",
    "DUMMY_DATA": "DummyData",
    "EUCLIDEAN_LOSS": "EuclideanLoss",
    "ELTWISE": "Eltwise",
    "EXP": "Exp",
    "FLATTEN": "Flatten",
    "HDF5_DATA": "HDF5Data",
    "HDF5_OUTPUT": "HDF5Output",
    "HINGE_LOSS": "HingeLoss",
    "IM2COL": "Im2col",
    "IMAGE_DATA": "ImageData",
    "INFOGAIN_LOSS": "InfogainLoss",
    "INNER_PRODUCT": "InnerProduct",
    "LRN": "LRN",
    "MEMORY_DATA": "MemoryData",
    "MULTINOMIAL_LOGISTIC_LOSS": "MultinomialLogisticLoss",
    "MVN": "MVN",
    "POOLING": "Pooling",
    "POWER": "Power",
    "RELU": "ReLU",
    "SIGMOID": "Sigmoid",
    "SIGMOID_CROSS_ENTROPY_LOSS": "SigmoidCrossEntropyLoss",
    "SILENCE": "Silence",
    "SOFTMAX": "Softmax",
    "SOFTMAX_LOSS": "SoftmaxWithLoss",
    "SPLIT": "Split",
    "SLICE": "Slice",
    "TANH": "TanH",
    "WINDOW_DATA": "WindowData",
    "THRESHOLD": "Threshold",
}

# Every ``*_param`` sub-message of V1LayerParameter; each has a same-named field in LayerParameter.
_V1_SUB_PARAMS = tuple(f.name for f in V1.DESCRIPTOR.fields if f.name.endswith("_param"))
assert all(n in caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name for n in _V1_SUB_PARAMS)


def net_needs_v1_to_v2_upgrade(net: NetParameter) -> bool:
    """True iff the net has V1 ``layers`` entries."""
    return len(net.layers) > 0


def upgrade_v1_layer(v1: V1) -> tuple[caffe_pb2.LayerParameter, bool]:
    """One V1 layer as a ``LayerParameter``; returns ``(layer, fully_compatible)``.

    ``param[i]`` (names), ``blob_share_mode[i]``, ``blobs_lr[i]`` and ``weight_decay[i]`` become
    ``param[i].name/.share_mode/.lr_mult/.decay_mult``; the ``param`` list is padded with default
    ParamSpecs so that index ``i`` exists.
    """
    out = caffe_pb2.LayerParameter()
    ok = True
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField("name"):
        out.name = v1.name
    out.include.extend(v1.include)
    out.exclude.extend(v1.exclude)
    if v1.HasField("type"):
        out.type = V1_TYPE_TO_STRING[V1.LayerType.Name(v1.type)]
    out.blobs.extend(v1.blobs)

    def spec(i: int) -> caffe_pb2.ParamSpec:
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        # V1 and ParamSpec DimCheckMode share names and numbers (STRICT, PERMISSIVE).
        spec(i).share_mode = caffe_pb2.ParamSpec.DimCheckMode.Value(V1.DimCheckMode.Name(mode))
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for name in _V1_SUB_PARAMS:
        if v1.HasField(name):
            getattr(out, name).CopyFrom(getattr(v1, name))
    if v1.HasField("layer"):
        log.error("Input NetParameter has V0 layer -- ignoring.")
        ok = False
    return out, ok


def upgrade_v1_net(net: NetParameter, source: str = "<net>") -> bool:
    """V1 -> V2 (in place): every ``layers`` entry becomes a ``layer`` entry.

    A net that mixes ``layer`` and ``layers`` is rejected (Caffe drops the ``layer`` entries with an
    error message, which silently changes the net).
    """
    if len(net.layer) > 0:
        raise CctError(f"{source}: the net uses both 'layer' (current) and 'layers' (deprecated V1) "
                       "fields; use only 'layer'")
    ok = True
    upgraded = []
    for i, v1 in enumerate(net.layers):
        layer, layer_ok = upgrade_v1_layer(v1)
        if not layer_ok:
            log.error(f"Upgrade of input layer {i} failed.")
            ok = False
        upgraded.append(layer)
    del net.layers[:]
    net.layer.extend(upgraded)
    return ok


# ------------------------------------------------------------------------------------------------
# Net-level inputs -> Input layer
# ------------------------------------------------------------------------------------------------

def net_needs_input_upgrade(net: NetParameter) -> bool:
    """True iff the net declares net-level ``input`` fields."""
    return len(net.input) > 0


def upgrade_net_input(net: NetParameter, source: str = "<net>") -> None:
    """Turn ``input`` + ``input_shape``/``input_dim`` into an ``Input`` layer named ``"input"`` at
    position 0 (in place).

    ``input_shape[i]`` is used if any ``input_shape`` is given, else ``input_dim[4i:4i+4]``.  Inputs
    without any shape (old caffemodels) are just dropped.  The three fields are cleared.
    """
    n = len(net.input)
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if has_shape or has_dim:
        if has_shape and len(net.input_shape) < n:
            raise CctError(f"{source}: {n} inputs but only {len(net.input_shape)} input_shape entries")
        if not has_shape and len(net.input_dim) < 4 * n:
            raise CctError(f"{source}: {n} inputs need {4 * n} input_dim values (4 per input), "
                           f"got {len(net.input_dim)}")
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, top in enumerate(net.input):
            layer.top.append(top)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i:4 * i + 4])
        rest = NetParameter()
        rest.layer.extend(net.layer)
        del net.layer[:]
        net.layer.append(layer)
        net.layer.extend(rest.layer)
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


# ------------------------------------------------------------------------------------------------
# BatchNorm with hand-written param specs
# ------------------------------------------------------------------------------------------------

def net_needs_batchnorm_upgrade(net: NetParameter) -> bool:
    """True iff a ``BatchNorm`` layer declares exactly three ``param`` specs (the old way to keep
    the solver off its statistics)."""
    return any(l.type == "BatchNorm" and len(l.param) == 3 for l in net.layer)


def upgrade_net_batchnorm(net: NetParameter) -> None:
    """Set ``lr_mult: 0`` and ``decay_mult: 0`` on those three specs (other fields kept)."""
    for l in net.layer:
        if l.type == "BatchNorm" and len(l.param) == 3:
            for p in l.param:
                p.lr_mult = 0.0
                p.decay_mult = 0.0


# ------------------------------------------------------------------------------------------------
# All together
# ------------------------------------------------------------------------------------------------

def net_needs_upgrade(net: NetParameter) -> bool:
    """Caffe's ``NetNeedsUpgrade``: V0 or V1 layers present."""
    return net_needs_v0_to_v1_upgrade(net) or net_needs_v1_to_v2_upgrade(net)


def upgrade_net_as_needed(net: NetParameter, source: str = "<net>") -> bool:
    """Apply every needed upgrade in Caffe's order (V0->V1, data transform, V1->V2, inputs,
    BatchNorm), logging Caffe's lines.  Returns False if some step was not fully compatible."""
    success = True
    if net_needs_v0_to_v1_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated V0LayerParameter: "
                 f"{source}")
        if upgrade_v0_net(net, source):
            log.info("Successfully upgraded file specified using deprecated V0LayerParameter")
        else:
            success = False
            log.error("Warning: had one or more problems upgrading V0NetParameter to NetParameter "
                      "(see above); continuing anyway.")
        log.warning("Note that future Caffe releases will not support V0NetParameter; use "
                    "./build/tools/upgrade_net_proto_text for prototxt and "
                    "./build/tools/upgrade_net_proto_binary for model weights upgrade this and any "
                    "other net protos to the new format.")
    if net_needs_data_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated transformation "
                 f"parameters: {source}")
        upgrade_net_data_transformation(net)
        log.info("Successfully upgraded file specified using deprecated data transformation "
                 "parameters.")
        log.warning("Note that future Caffe releases will only support transform_param messages "
                    "for transformation fields.")
    if net_needs_v1_to_v2_upgrade(net):
        log.info(f"Attempting to upgrade input file specified using deprecated V1LayerParameter: "
                 f"{source}")
        if upgrade_v1_net(net, source):
            log.info("Successfully upgraded file specified using deprecated V1LayerParameter")
        else:
            success = False
            log.error("Warning: had one or more problems upgrading V1LayerParameter (see above); "
                      "continuing anyway.")
    if net_needs_input_upgrade(net):
        log.info(f"Attempting to upgrade input file specified using deprecated input fields: {source}")
        upgrade_net_input(net, source)
        log.info("Successfully upgraded file specified using deprecated input fields.")
        log.warning("Note that future Caffe releases will only support input layers and not input "
                    "fields.")
    if net_needs_batchnorm_upgrade(net):
        log.info(f"Attempting to upgrade batch norm layers using deprecated params: {source}")
        upgrade_net_batchnorm(net)
        log.info("Successfully upgraded batch norm layers using deprecated params.")
    return success


# ------------------------------------------------------------------------------------------------
# Solver
# ------------------------------------------------------------------------------------------------

#: Legacy ``solver_type`` enum name -> ``type`` string.
SOLVER_TYPE_TO_STRING: dict[str, str] = {
    "SGD": "SGD",
    "NESTEROV": "Nesterov",
    "ADAGRAD": "AdaGrad",
    "RMSPROP": "RMSProp",
    "ADADELTA": "AdaDelta",
    "ADAM": "Adam",
}


def solver_needs_type_upgrade(solver: caffe_pb2.SolverParameter) -> bool:
    """True iff the legacy ``solver_type`` enum is set."""
    return solver.HasField("solver_type")


def upgrade_solver_type(solver: caffe_pb2.SolverParameter, source: str = "<solver>") -> bool:
    """Replace ``solver_type: ENUM`` by ``type: "String"`` (in place).  Both set is an error.
    Returns False (and logs) if there was nothing to upgrade."""
    if solver.HasField("solver_type") and solver.HasField("type"):
        raise CctError(f"{source}: the old solver_type field (enum) and the new type field (string) "
                       "cannot both be specified")
    if not solver.HasField("solver_type"):
        log.error("Warning: solver type already up to date. ")
        return False
    name = caffe_pb2.SolverParameter.SolverType.Name(solver.solver_type)
    solver.type = SOLVER_TYPE_TO_STRING[name]
    solver.ClearField("solver_type")
    return True


def upgrade_solver_as_needed(solver: caffe_pb2.SolverParameter, source: str = "<solver>") -> bool:
    """Apply the solver upgrades, logging Caffe's lines.  Returns False on a partial upgrade."""
    success = True
    if solver_needs_type_upgrade(solver):
        log.info("Attempting to upgrade input file specified using deprecated 'solver_type' field "
                 f"(enum)': {source}")
        if upgrade_solver_type(solver, source):
            log.info("Successfully upgraded file specified using deprecated 'solver_type' field "
                     "(enum) to 'type' field (string).")
            log.warning("Note that future Caffe releases will only support 'type' field (string) "
                        "for a solver's type.")
        else:
            success = False
            log.error("Warning: had one or more problems upgrading SolverType (see above).")
    return success
