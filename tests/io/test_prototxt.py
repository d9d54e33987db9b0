"""Text prototxt reading/writing (cct.io.prototxt)."""
from __future__ import annotations

from pathlib import Path

import pytest

from cct.errors import CctError
from cct.io.prototxt import (
    find_layer_line,
    find_layer_line_in_text,
    parse_net_param,
    parse_solver_param,
    read_net_param,
    read_net_param_any,
    read_solver_param,
    write_text,
)
from cct.io.weights import write_caffemodel
from cct.proto import caffe_pb2

REFERENCE = Path(__file__).resolve().parents[2] / ".." / "shared" / "caffe-reference"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(),
                                     reason=f"Caffe reference files not found at {REFERENCE}")

NET = """name: "tiny"
# a comment with a { brace
layer {
  name: "data"
  type: "Input"
  top: "data"
  input_param { shape { dim: 2 dim: 3 } }
}
layer {
  name: "ip"
  type: "InnerProduct"
  bottom: "data"
  top: "ip"
  param { name: "ip" lr_mult: 1 }
  inner_product_param { num_output: 4 }
}
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_read_net_param(tmp_path):
    p = write(tmp_path, "net.prototxt", NET)
    n = read_net_param(p)
    assert n.name == "tiny" and [l.name for l in n.layer] == ["data", "ip"]
    assert n.layer[1].inner_product_param.num_output == 4


def test_parse_net_param_from_string_upgrades():
    n = parse_net_param('input: "x" input_shape { dim: 1 } '
                        'layers { name: "r" type: RELU bottom: "x" top: "x" }')
    assert [(l.name, l.type) for l in n.layer] == [("input", "Input"), ("r", "ReLU")]


def test_missing_file():
    with pytest.raises(CctError) as e:
        read_net_param("/nonexistent/dir/net.prototxt")
    assert str(e.value) == "Could not open file /nonexistent/dir/net.prototxt"


def test_syntax_error_has_line_and_column(tmp_path):
    p = write(tmp_path, "bad.prototxt", 'name: "x"\nlayer {\n  name: "a"\n  type "ReLU"\n}\n')
    with pytest.raises(CctError) as e:
        read_net_param(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:4:")
    assert "\n" not in msg


def test_unknown_field_names_line_and_field(tmp_path):
    p = write(tmp_path, "bad.prototxt", 'name: "x"\nlayer {\n  name: "a"\n  colour: 3\n}\n')
    with pytest.raises(CctError) as e:
        read_net_param(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:4:3: ")
    assert 'no field named "colour"' in msg


def test_unclosed_block(tmp_path):
    p = write(tmp_path, "bad.prototxt", 'layer {\n  name: "a"\n')
    with pytest.raises(CctError, match=rf"^{p}:\d+:\d+: "):
        read_net_param(p)


def test_parse_error_from_string_names_source():
    with pytest.raises(CctError, match=r"^<string>:1:\d+: "):
        parse_net_param("layer { nme: 1 }")
    with pytest.raises(CctError, match=r"^spec:1:\d+: "):
        parse_net_param("layer { nme: 1 }", source="spec")


def test_binary_file_as_prototxt_is_a_clear_error(tmp_path):
    p = tmp_path / "w.caffemodel"
    p.write_bytes(b"\n\x04tiny\xa2\x06\x80\xff\x00")
    with pytest.raises(CctError, match="not a text file"):
        read_net_param(p)


def test_solver_param_with_legacy_type(tmp_path):
    p = write(tmp_path, "solver.prototxt", 'net: "net.prototxt"\nbase_lr: 0.01\nsolver_type: ADAGRAD\n')
    s = read_solver_param(p)
    assert s.type == "AdaGrad" and not s.HasField("solver_type") and s.net == "net.prototxt"
    assert parse_solver_param("solver_type: RMSPROP").type == "RMSProp"


def test_write_text_round_trip(tmp_path):
    n = parse_net_param(NET)
    p = tmp_path / "out.prototxt"
    write_text(p, n)
    assert read_net_param(p) == n
    assert 'name: "tiny"' in p.read_text()
    s = parse_solver_param('base_lr: 0.5 lr_policy: "step" stepsize: 10 type: "Adam"')
    write_text(tmp_path / "s.prototxt", s)
    assert read_solver_param(tmp_path / "s.prototxt") == s
    assert [f.name for f in tmp_path.iterdir() if f.name.startswith(".")] == []


def test_find_layer_line(tmp_path):
    p = write(tmp_path, "net.prototxt", NET)
    assert find_layer_line(p, "data") == 4
    assert find_layer_line(p, "ip") == 10   # not the `param { name: "ip" }` on line 14
    assert find_layer_line(p, "absent") is None
    assert find_layer_line(tmp_path / "missing.prototxt", "data") is None


def test_find_layer_line_tricky_text():
    text = '\n'.join([
        'name: "net"',                                  # 1  net name, not a layer
        '# layer { name: "c" }',                        # 2  comment
        'layer: {',                                     # 3
        '  type: "Python" python_param { param_str: "layer { name: \\"c\\" }" }',  # 4 string
        '  include { stage: "x" }',                     # 5
        '  name:',                                      # 6
        '    "c"',                                      # 7
        '}',                                            # 8
        "layers { layer { name: 'v0' type: 'relu' } }",  # 9  V0 nesting, single quotes
        'layer < name: "angle" >',                      # 10 angle brackets
        'layer { name: "con" "cat" }',                  # 11 adjacent strings
    ])
    assert find_layer_line_in_text(text, "net") is None
    assert find_layer_line_in_text(text, "c") == 6
    assert find_layer_line_in_text(text, "v0") == 9
    assert find_layer_line_in_text(text, "angle") == 10
    assert find_layer_line_in_text(text, "concat") == 11


def test_read_net_param_any_binary_and_text(tmp_path):
    n = parse_net_param(NET)
    write_caffemodel(tmp_path / "w.caffemodel", n)
    assert read_net_param_any(tmp_path / "w.caffemodel") == n
    p = write(tmp_path, "net.prototxt", NET)
    assert read_net_param_any(p) == n
    bad = write(tmp_path, "bad.prototxt", 'layer { name: "x" junk: 1 }')
    with pytest.raises(CctError, match="junk"):
        read_net_param_any(bad)


@needs_reference
def test_reference_prototxts_parse():
    files = sorted(REFERENCE.glob("*/*/net.prototxt")) + sorted(REFERENCE.glob("*/*/solver.prototxt"))
    files.append(REFERENCE / "data_layer" / "net.prototxt")
    assert len(files) >= 10
    for f in files:
        if f.name == "solver.prototxt":
            assert read_solver_param(f).type
        else:
            n = read_net_param(f)
            assert n.layer
            for layer in n.layer:
                line = find_layer_line(f, layer.name)
                assert line is not None and f'"{layer.name}"' in f.read_text().splitlines()[line - 1]


@needs_reference
def test_reference_caffemodel_via_read_net_param_any():
    n = read_net_param_any(REFERENCE / "nets" / "lenet" / "weights.caffemodel")
    assert isinstance(n, caffe_pb2.NetParameter) and any(len(l.blobs) for l in n.layer)
