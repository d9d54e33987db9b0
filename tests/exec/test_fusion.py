"""The serial executor's fused pairs (an in-place ReLU and the MAX pooling after it, backward; a Convolution and
the in-place ReLU after it, forward; BatchNorm, Scale and ReLU; an Eltwise sum and its ReLU) give exactly the
numbers of the layers run one by one, are found only where they apply, and run only inside passes that cover both
layers with nothing watching in between."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.exec.fusion import backward_pairs
from tests.helpers import BODIES, select_body

FILLERS = 'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.3 }'


def _net_text(relu2: str = 'bottom: "conv2" top: "conv2"', pool2: str = "pool: MAX kernel_size: 2 stride: 2",
              extra: str = "") -> str:
    return f"""
name: "fusable" force_backward: true
input: "data" input_shape {{ dim: 3 dim: 2 dim: 13 dim: 13 }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 {FILLERS} }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} }}
layer {{ name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param {{ num_output: 6 kernel_size: 2 pad: 1 {FILLERS} }} }}
layer {{ name: "relu2" type: "ReLU" {relu2} }}
layer {{ name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param {{ {pool2} }} }}
{extra}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool2" top: "ip" inner_product_param {{ num_output: 3 {FILLERS} }} }}
"""


def _net(tmp_path, text: str | None = None, watched: bool = False, phase: int = cct.TRAIN):
    path = tmp_path / "net.prototxt"
    path.write_text(text or _net_text())
    net = cct.Net(str(path), phase)
    rng = np.random.default_rng(7)
    for ps in net.params.values():  # the same weights for every net of a test
        for p in ps:
            p.data[...] = rng.standard_normal(p.data.shape).astype(p.data.dtype)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    if watched:  # a per-layer callback: the layers then run one by one
        net.before_forward_hooks.append(lambda i: None)
        net.before_backward_hooks.append(lambda i: None)
    return net


def _pass(net, top_diff) -> dict[str, np.ndarray]:
    net.forward()
    net.blobs["ip"].diff[...] = top_diff
    net.clear_param_diffs()
    net.backward()
    out = {f"{n}.data": b.data.copy() for n, b in net.blobs.items()}
    out.update({f"{n}.diff": b.diff.copy() for n, b in net.blobs.items()})
    out.update({f"{n}.{j}.diff": p.diff.copy() for n, ps in net.params.items() for j, p in enumerate(ps)})
    return out


def _count_calls(net, names=("relu1", "relu2"), methods=("backward",)) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name in names:
        layer = net.layer_dict[name]
        for m in methods:
            original = getattr(layer, m)

            def spy(*a, _o=original, _k=f"{name}.{m}", **k):
                calls[_k] = calls.get(_k, 0) + 1
                return _o(*a, **k)
            setattr(layer, m, spy)
    return calls


def test_pairs_found_where_they_apply(tmp_path):
    net = _net(tmp_path)
    assert backward_pairs(net) == {3: 2, 6: 5}  # layer 0 is the Input
    cases = {
        "ReLU not in place": _net_text(relu2='bottom: "conv2" top: "conv2r"').replace(
            'bottom: "conv2" top: "pool2"', 'bottom: "conv2r" top: "pool2"'),
        "leaky ReLU": _net_text(relu2='bottom: "conv2" top: "conv2" relu_param { negative_slope: 0.1 }'),
        "average pooling": _net_text(pool2="pool: AVE kernel_size: 2 stride: 2"),
        "the ReLU's blob read again": _net_text(extra='layer { name: "peek" type: "Power" bottom: "conv2" '
                                                      'top: "peek" }'),
    }
    for what, text in cases.items():
        other = _net(tmp_path, text)
        assert backward_pairs(other) == {3: 2}, what  # the first pair is untouched


def test_a_convolution_and_the_relu_after_it_run_as_one_step_forward(tmp_path, monkeypatch, body):
    """A Convolution and the plain in-place ReLU on its only top: the engine rectifies the output as it writes it
    and the ReLU's forward does not run; the pair is found only where it applies; forward and backward passes give
    the bits of the layers run one by one (a watched net)."""
    from cct.exec.fusion import rectified_convs

    net = _net(tmp_path)
    assert rectified_convs(net) == {1: 2, 4: 5}
    cases = {
        "ReLU not in place": _net_text(relu2='bottom: "conv2" top: "conv2r"').replace(
            'bottom: "conv2" top: "pool2"', 'bottom: "conv2r" top: "pool2"'),
        "leaky ReLU": _net_text(relu2='bottom: "conv2" top: "conv2" relu_param { negative_slope: 0.1 }'),
        "a layer between": _net_text(relu2='bottom: "conv2" top: "conv2"').replace(
            'layer { name: "relu2"', 'layer { name: "scaled" type: "Power" bottom: "conv2" top: "conv2" }\n'
            'layer { name: "relu2"'),
    }
    for what, text in cases.items():
        assert rectified_convs(_net(tmp_path, text)) == {1: 2}, what
    calls = _count_calls(net, methods=("forward",))
    top_diff = np.random.default_rng(5).standard_normal(net.blobs["ip"].diff.shape).astype(np.float32)
    got = [_pass(net, top_diff) for _ in range(2)]
    assert calls == {}  # both ReLUs' forwards ran inside the convolutions
    plain = _net(tmp_path, watched=True)
    plain_calls = _count_calls(plain, methods=("forward",))
    want = [_pass(plain, top_diff) for _ in range(2)]
    assert plain_calls == {"relu1.forward": 2, "relu2.forward": 2}
    assert (want[0]["conv1.data"] == 0).any() and (want[0]["conv2.data"] == 0).any()  # the ReLUs did clip
    for a, b in zip(got, want):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    net.forward(end="conv2")  # a pass that ends at the convolution leaves its top as the convolution wrote it
    assert calls == {}  # (conv1 and relu1 as one step)
    assert (net.blobs["conv2"].data < 0).any()


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST], ids=["TRAIN", "TEST"])  # TEST: winners found again
@pytest.mark.parametrize("poison", [False, True], ids=["finite", "nan-and-inf-gradient"])
def test_fused_passes_equal_the_layers_one_by_one(tmp_path, poison, phase):
    fused, plain = _net(tmp_path, phase=phase), _net(tmp_path, watched=True, phase=phase)
    calls = _count_calls(fused)
    top_diff = np.random.default_rng(3).standard_normal(fused.blobs["ip"].diff.shape).astype(np.float32)
    if poison:  # non-finite gradients go where ReLU's dy * (y > 0) sends them (NaN * 0 is NaN)
        top_diff[0, 0], top_diff[1, 2] = np.nan, np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        got, want = _pass(fused, top_diff), _pass(plain, top_diff)
    assert calls == {}  # both ReLUs' backward ran inside the poolings
    assert (want["conv1.data"] == 0).any() and (want["pool1.data"] == 0).any()  # the ReLUs did clip
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_partial_passes_and_debug_info_run_the_layers_themselves(tmp_path):
    fused, plain = _net(tmp_path), _net(tmp_path, watched=True)
    calls = _count_calls(fused)
    top_diff = np.ones(fused.blobs["ip"].diff.shape, dtype=np.float32)
    for net in (fused, plain):
        net.forward()
        net.blobs["ip"].diff[...] = top_diff
        net.backward(end="pool1")  # pool1's backward without relu1's: conv1's gradient is not masked
    assert calls == {}  # relu2's backward ran inside pool2's
    assert (plain.blobs["conv1"].diff[plain.blobs["conv1"].data == 0] != 0).any()
    np.testing.assert_array_equal(fused.blobs["conv1"].diff, plain.blobs["conv1"].diff)
    for net in (fused, plain):
        net.backward(start="relu1")
    assert calls == {"relu1.backward": 1}
    np.testing.assert_array_equal(fused.blobs["data"].diff, plain.blobs["data"].diff)
    fused.debug_info = True  # its lines print each layer's own gradients
    fused.forward()
    fused.backward()
    assert calls == {"relu1.backward": 2, "relu2.backward": 1}


# ---- forward: BatchNorm -> in-place Scale ---------------------------------------------------------------
BN_TEXT = f"""
name: "normalized" force_backward: true
input: "data" input_shape {{ dim: 4 dim: 2 dim: 5 dim: 5 }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 3 kernel_size: 3 {FILLERS} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }}
layer {{ name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param {{ bias_term: true }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "bn2" type: "BatchNorm" bottom: "conv1" top: "norm2" }}
layer {{ name: "scale2" type: "Scale" bottom: "norm2" top: "norm2" }}
layer {{ name: "bn3" type: "BatchNorm" bottom: "norm2" top: "norm3" }}
layer {{ name: "scale3" type: "Scale" bottom: "norm3" top: "scaled3" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "scaled3" top: "ip"
        inner_product_param {{ num_output: 3 {FILLERS} }} }}
"""


@pytest.fixture(params=BODIES)
def body(request, monkeypatch):
    return select_body(request, monkeypatch)


@pytest.mark.parametrize("phase", [cct.TRAIN, cct.TEST])
def test_batchnorm_and_scale_run_as_one_step(tmp_path, monkeypatch, body, phase):
    """A per-channel Scale in place right after a BatchNorm: with the compiled kernels both forwards run as one
    pass — with the in-place ReLU after scale1 too (rectified as it is written) —; otherwise the Scale keeps its
    input in the BatchNorm's copy.  Backward, the ReLU's, the Scale's and the BatchNorm's steps run block by block
    together (the ReLU's with the compiled kernels).  Training passes give the bits of the layers run one by one
    (a watched net), with batch and with global statistics; a Scale not in place is left alone."""
    from cct.exec.fusion import forward_pairs
    from cct.layers.normalization import BatchNormLayer

    ran: list[str] = []
    real, real_backward = BatchNormLayer.forward_scaled, BatchNormLayer.backward_scaled

    def spy(norm, bottom, top, scale, rectify=False):
        done = real(norm, bottom, top, scale, rectify)
        if done:
            ran.append((scale.name, rectify))
        return done

    def spy_backward(norm, top, bottom, scale, rectify=False):
        done = real_backward(norm, top, bottom, scale, rectify)
        if done:
            ran.append(("backward", scale.name, rectify))
        return done

    monkeypatch.setattr(BatchNormLayer, "forward_scaled", spy)
    monkeypatch.setattr(BatchNormLayer, "backward_scaled", spy_backward)
    net = _net(tmp_path, BN_TEXT, phase=phase)
    names = net._layer_names
    assert {names[j]: names[i] for j, i in forward_pairs(net).items()} == {"scale1": "bn1", "scale2": "bn2"}
    top_diff = np.random.default_rng(3).standard_normal((4, 3))
    fused = [_pass(net, top_diff) for _ in range(2)]
    compiled = body == "compiled"
    backward = [("backward", "scale2", False)] + ([("backward", "scale1", True)] if compiled else [])
    assert ran == ([("scale1", True), ("scale2", False)] + backward) * 2 if compiled else backward * 2
    assert (fused[0]["conv1.data"] == 0).any() and (fused[0]["conv1.data"] > 0).any()  # relu1 did clip
    if phase == cct.TRAIN:  # the Scales keep their inputs in the BatchNorms' copies
        assert net.layer_dict["scale1"]._x_copy is None and net.layer_dict["scale2"]._x_copy is None
        assert net.layer_dict["scale1"]._saved is net.layer_dict["bn1"].kept_output()
    else:  # global statistics keep no copy: the Scale keeps its own
        assert net.layer_dict["bn1"].kept_output() is None and net.layer_dict["scale1"]._x_copy is not None
    watched = _net(tmp_path, BN_TEXT, watched=True, phase=phase)
    plain = [_pass(watched, top_diff) for _ in range(2)]
    assert watched.layer_dict["scale1"]._x_copy is not None
    for a, b in zip(fused, plain):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for name, params in net.params.items():  # the BatchNorms' running sums too (updated once a pass)
        for j, p in enumerate(params):
            np.testing.assert_array_equal(p.data, watched.params[name][j].data, err_msg=f"{name}.{j}")


def test_a_pass_starting_at_the_scale_keeps_its_own_copy(tmp_path):
    """A forward that starts at the Scale (the blob changed since the BatchNorm ran) copies the Scale's input
    itself: its gradients are those of the input it saw, as with the layers run one by one."""
    diffs = []
    for watched in (False, True):
        net = _net(tmp_path, BN_TEXT, watched=watched)
        net.forward()
        blob = net.blobs["conv1"]
        blob.data[...] = np.random.default_rng(5).standard_normal(blob.data.shape)
        seen = blob.data.copy()
        net.forward(start="scale1")
        scale = net.layer_dict["scale1"]
        assert scale._saved is scale._x_copy
        np.testing.assert_array_equal(scale._x_copy, seen)
        net.clear_param_diffs()
        net.blobs["ip"].diff[...] = 1.0
        net.backward()
        diffs.append({f"{n}.{j}": p.diff.copy() for n, ps in net.params.items() for j, p in enumerate(ps)})
    for key in diffs[0]:
        np.testing.assert_array_equal(diffs[0][key], diffs[1][key], err_msg=key)


# ---- forward: Eltwise sum -> in-place ReLU ----------------------------------------------------------------
RESIDUAL_TEXT = f"""
name: "residual" force_backward: true
input: "data" input_shape {{ dim: 3 dim: 4 dim: 6 dim: 6 }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 {FILLERS} }} }}
layer {{ name: "sum1" type: "Eltwise" bottom: "data" bottom: "conv1" top: "sum1" }}
layer {{ name: "relu1" type: "ReLU" bottom: "sum1" top: "sum1" }}
layer {{ name: "sum2" type: "Eltwise" bottom: "sum1" bottom: "conv1" top: "sum2"
        eltwise_param {{ coeff: 1 coeff: -0.5 }} }}
layer {{ name: "relu2" type: "ReLU" bottom: "sum2" top: "sum2" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "sum2" top: "ip" inner_product_param {{ num_output: 3 {FILLERS} }} }}
"""


def test_an_eltwise_sum_and_the_relu_after_it_run_as_one_step(tmp_path, monkeypatch, body):
    """A plain two-bottom sum (coefficients 1) and the in-place ReLU on its top: with the compiled kernels one pass
    adds and rectifies; a sum with other coefficients runs its layers one by one.  Training passes give the bits of
    the layers run one by one (a watched net)."""
    from cct.exec.fusion import rectified_sums
    from cct.layers.eltwise import EltwiseLayer

    ran: list[tuple[str, bool]] = []
    real = EltwiseLayer.forward_rectified

    def spy(layer, bottom, top):
        done = real(layer, bottom, top)
        ran.append((layer.name, done))
        return done

    monkeypatch.setattr(EltwiseLayer, "forward_rectified", spy)
    net = _net(tmp_path, RESIDUAL_TEXT)
    names = net._layer_names
    assert {names[i]: names[j] for i, j in rectified_sums(net).items()} == {"sum1": "relu1"}  # sum2: coefficients
    top_diff = np.random.default_rng(4).standard_normal((3, 3))
    fused = [_pass(net, top_diff) for _ in range(2)]
    compiled = body == "compiled"
    assert ran == [("sum1", compiled)] * 2
    assert (fused[0]["sum1.data"] == 0).any() and (fused[0]["sum1.data"] > 0).any()  # relu1 did clip
    plain = [_pass(_net(tmp_path, RESIDUAL_TEXT, watched=True), top_diff) for _ in range(2)]
    for a, b in zip(fused, plain):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
