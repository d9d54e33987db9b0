"""NetState filtering and Split insertion, as Caffe's FilterNet / InsertSplits."""
from __future__ import annotations

import pytest
from google.protobuf import text_format

from cct.errors import CctError
from cct.graph import filter_net, insert_splits, state_meets_rule
from cct.proto import caffe_pb2 as pb


def net(text: str) -> pb.NetParameter:
    return text_format.Parse(text, pb.NetParameter())


def rule(text: str) -> pb.NetStateRule:
    return text_format.Parse(text, pb.NetStateRule())


def state(text: str) -> pb.NetState:
    return text_format.Parse(text, pb.NetState())


@pytest.mark.parametrize("st,r,expected", [
    ("phase: TRAIN", "phase: TRAIN", True),
    ("phase: TEST", "phase: TRAIN", False),
    ("phase: TEST", "", True),
    ("level: 2", "min_level: 2", True),
    ("level: 1", "min_level: 2", False),
    ("level: 3", "max_level: 2", False),
    ("stage: 'a' stage: 'b'", "stage: 'a' stage: 'b'", True),
    ("stage: 'a'", "stage: 'a' stage: 'b'", False),
    ("stage: 'a'", "not_stage: 'a'", False),
    ("stage: 'b'", "not_stage: 'a'", True),
])
def test_state_meets_rule(st: str, r: str, expected: bool) -> None:
    assert state_meets_rule(state(st), rule(r)) is expected


def test_filter_include_exclude() -> None:
    p = net("""
      state { phase: TEST stage: "deploy" }
      layer { name: "a" type: "Input" top: "x" }
      layer { name: "train_only" type: "ReLU" bottom: "x" top: "x" include { phase: TRAIN } }
      layer { name: "test_only" type: "ReLU" bottom: "x" top: "x" include { phase: TEST } }
      layer { name: "not_deploy" type: "ReLU" bottom: "x" top: "x" exclude { stage: "deploy" } }
      layer { name: "either" type: "ReLU" bottom: "x" top: "x" include { phase: TRAIN } include { stage: "deploy" } }
    """)
    assert [layer.name for layer in filter_net(p).layer] == ["a", "test_only", "either"]


def test_filter_rejects_include_and_exclude() -> None:
    p = net('layer { name: "a" type: "Input" top: "x" include { phase: TRAIN } exclude { phase: TEST } }')
    with pytest.raises(CctError, match="both include and exclude"):
        filter_net(p)


def test_insert_splits_names_and_rewiring() -> None:
    p = insert_splits(net("""
      layer { name: "data" type: "Input" top: "data" top: "label" }
      layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }
      layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
      layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """))
    names = [layer.name for layer in p.layer]
    assert names == ["data", "label_data_1_split", "ip", "ip_ip_0_split", "acc", "loss"]
    split = p.layer[1]
    assert list(split.bottom) == ["label"]
    assert list(split.top) == ["label_data_1_split_0", "label_data_1_split_1"]
    assert list(p.layer[4].bottom) == ["ip_ip_0_split_0", "label_data_1_split_0"]
    assert list(p.layer[5].bottom) == ["ip_ip_0_split_1", "label_data_1_split_1"]


def test_insert_splits_in_place_chain_resolves_latest_producer() -> None:
    p = insert_splits(net("""
      layer { name: "data" type: "Input" top: "x" }
      layer { name: "relu" type: "ReLU" bottom: "x" top: "x" }
      layer { name: "a" type: "AbsVal" bottom: "x" top: "a" }
      layer { name: "b" type: "AbsVal" bottom: "x" top: "b" }
    """))
    assert [layer.name for layer in p.layer] == ["data", "relu", "x_relu_0_split", "a", "b"]
    assert list(p.layer[1].bottom) == ["x"]  # a single consumer: no split between data and relu
    assert list(p.layer[3].bottom) == ["x_relu_0_split_0"]


def test_insert_splits_with_explicit_loss_weight() -> None:
    p = insert_splits(net("""
      layer { name: "data" type: "Input" top: "x" }
      layer { name: "e" type: "EuclideanLoss" bottom: "x" bottom: "x" top: "l" loss_weight: 2 }
      layer { name: "r" type: "ReLU" bottom: "x" top: "y" loss_weight: 3 }
      layer { name: "s" type: "AbsVal" bottom: "y" top: "z" }
    """))
    split = [layer for layer in p.layer if layer.name == "y_r_0_split"][0]
    assert list(split.loss_weight) == [3.0, 0.0]
    r = [layer for layer in p.layer if layer.name == "r"][0]
    assert list(r.loss_weight) == []
    s = [layer for layer in p.layer if layer.name == "s"][0]
    assert list(s.bottom) == ["y_r_0_split_1"]


def test_unknown_bottom() -> None:
    with pytest.raises(CctError, match="Unknown bottom blob 'nope'"):
        insert_splits(net('layer { name: "a" type: "ReLU" bottom: "nope" top: "x" }'))
