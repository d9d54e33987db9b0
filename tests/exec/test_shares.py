"""Device settings and batch shares: ``-split`` fractions, peak-FLOPS weights, where settings come from."""
from __future__ import annotations

import pytest

import cct
from cct.device import Device
from cct.errors import CctError
from cct.exec import device_split as devices
from cct.exec.device_split import DeviceSplitRunner, batch_shares, device_setting, parse_split
from cct.exec.serial import LayerRunner

CPU1 = Device("cpu", 0, 1)
TWO = [CPU1, CPU1]


def test_shares_follow_the_weights_and_cover_the_batch():
    assert batch_shares(8, TWO, [1, 1], "x") == [4, 4]
    assert batch_shares(8, TWO, [0.75, 0.25], "x") == [6, 2]
    assert batch_shares(6, TWO, [0.75, 0.25], "x") == [5, 1]  # 4.5 / 1.5: the tie goes to the first
    assert batch_shares(7, [CPU1] * 3, [1, 1, 1], "x") == [3, 2, 2]
    assert batch_shares(10, TWO, [70.0, 30.0], "x") == [7, 3]  # GFLOP/s weights need not sum to 1
    for b in range(3, 40):
        assert sum(batch_shares(b, [CPU1] * 3, [0.5, 0.3, 0.2], "x")) == b


def test_an_empty_share_is_one_line_naming_the_device():
    with pytest.raises(CctError) as e:
        batch_shares(8, TWO, [0.99, 0.01], "by -split")
    assert str(e.value) == ("cpu:1 (device 2 of 2) gets 0 of a batch of 8 (by -split: share 0.01); every device "
                            "needs at least one item")


@pytest.mark.parametrize("text, words", [
    ("0.5,0.6", "sum to 1.1, not 1"),
    ("0.5", "1 fraction(s) for 2 device(s)"),
    ("1,0", "cpu:1 gets a share of 0"),
    ("0.5,x", "expected 'auto' or comma-separated fractions"),
    ("-0.5,1.5", "gets a share of -0.5"),
])
def test_bad_splits_are_one_line(text, words):
    with pytest.raises(CctError) as e:
        parse_split(text, TWO, "-split")
    assert words in str(e.value) and str(e.value).startswith(f"-split {text}:") and "\n" not in str(e.value)


def test_split_within_tolerance_and_auto():
    assert parse_split("auto", TWO) is None and parse_split(None, TWO) is None
    assert parse_split("0.3333333,0.6666667", TWO) == (0.3333333, 0.6666667)
    assert parse_split([0.25, 0.75], TWO) == (0.25, 0.75)


def test_settings_come_from_set_devices_then_the_environment(monkeypatch):
    assert device_setting() is None
    monkeypatch.setenv("CCT_DEVICES", "cpu:1,cpu:2")
    monkeypatch.setenv("CCT_SPLIT", "0.5,0.5")
    s = device_setting()
    assert [d.name for d in s.devices] == ["cpu:1", "cpu:2"] and s.fractions == (0.5, 0.5)
    cct.set_devices("cpu:1,cpu:1", split="auto")
    assert device_setting().fractions is None and device_setting().source == "set_devices"
    cct.set_devices(None)
    assert device_setting().split_source == "CCT_SPLIT"
    monkeypatch.setenv("CCT_DEVICES", "cpu:1,tpu")
    with pytest.raises(CctError, match="^CCT_DEVICES cpu:1,tpu: unknown device 'tpu'"):
        device_setting()
    monkeypatch.delenv("CCT_DEVICES")
    with pytest.raises(CctError, match="CCT_SPLIT=0.5,0.5 needs CCT_DEVICES"):
        device_setting()


NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
"""


def _net(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    return cct.Net(str(path), cct.TEST)


def test_nets_built_afterwards_get_the_split(tmp_path, monkeypatch):
    from tests.solvers.helpers import captured_log

    assert type(_net(tmp_path).executor.runner) is LayerRunner
    cct.set_devices("cpu:1,cpu:1", split=[0.75, 0.25])
    with captured_log() as log:
        net = _net(tmp_path)
    assert isinstance(net.executor.runner, DeviceSplitRunner)
    assert "each batch of 4: cpu:1 gets 3, cpu:1 gets 1, by split" in log.getvalue()
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    cct.set_devices("cpu:1,cpu:1")
    with captured_log() as log:
        _net(tmp_path)
    assert "each batch of 4: cpu:1 gets 2, cpu:1 gets 2, by peak FLOPS (" in log.getvalue()
    cct.set_devices("cpu:1,cpu:1", split="0.9,0.1")
    with pytest.raises(CctError, match=r"cpu:1 \(device 2 of 2\) gets 0 of a batch of 4"):
        _net(tmp_path)
    devices.set_devices(None)
    assert type(_net(tmp_path).executor.runner) is LayerRunner
