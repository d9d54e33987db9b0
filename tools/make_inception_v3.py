"""Write Inception-v3 (Szegedy et al. 2016, "Rethinking the Inception Architecture") as a deploy prototxt with
cct's NetSpec:

    python tools/make_inception_v3.py [--batch 10] [--out models/inception_v3/deploy.prototxt]

299x299x3 input; a stem of five convolutions and two max poolings (35x35x192); three 35x35 modules (A),
a grid reduction to 17x17 (B), four 17x17 modules with factorised 7x7 convolutions (C, 128/160/160/192
channels inside), a grid reduction to 8x8 (D), two 8x8 modules with expanded 1x3/3x1 filter banks (E), 8x8
average pooling, dropout, a 1000-way classifier and softmax.  Every convolution has no bias and is followed
by BatchNorm (eps 0.001), Scale (with bias) and ReLU, all in place.  94 convolutions, 23.8 M parameters
(the auxiliary classifier, a training-only branch, is left out of the deploy net).  Each module concatenates
its branches once, in branch order (the 1x3/3x1 pairs of the E modules included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cct import layers as L  # noqa: E402
from cct import params as P  # noqa: E402
from cct.net_spec import NetSpec  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "models" / "inception_v3" / "deploy.prototxt"


class _Builder:
    """Adds named layers to one NetSpec (names as ``module/branch``)."""

    def __init__(self, batch: int):
        self.n = NetSpec()
        self.n.data = L.Input(shape=dict(dim=[batch, 3, 299, 299]))

    def conv(self, name: str, bottom, num_output: int, kernel: tuple[int, int], stride: int = 1,
             pad: tuple[int, int] = (0, 0)):
        """Convolution (no bias) + BatchNorm + Scale + ReLU, the last three in place."""
        kh, kw = kernel
        shape = dict(kernel_size=kh) if kh == kw else dict(kernel_h=kh, kernel_w=kw)
        ph, pw = pad
        if ph or pw:
            shape.update(dict(pad=ph) if ph == pw else dict(pad_h=ph, pad_w=pw))
        if stride != 1:
            shape["stride"] = stride
        n = self.n
        n[name] = L.Convolution(bottom, num_output=num_output, bias_term=False, **shape)
        n[f"{name}/bn"] = L.BatchNorm(n[name], eps=0.001, in_place=True)
        n[f"{name}/scale"] = L.Scale(n[name], bias_term=True, in_place=True)
        n[f"{name}/relu"] = L.ReLU(n[name], in_place=True)
        return n[name]

    def pool(self, name: str, bottom, method, kernel: int, stride: int, pad: int = 0):
        self.n[name] = L.Pooling(bottom, pool=method, kernel_size=kernel, stride=stride, pad=pad)
        return self.n[name]

    def concat(self, name: str, bottoms: list):
        self.n[name] = L.Concat(*bottoms)
        return self.n[name]


def module_a(b: _Builder, name: str, x, pool_features: int):
    """35x35: 1x1 | 1x1→5x5 | 1x1→3x3→3x3 | avg pool→1x1."""
    c = b.conv
    b1 = c(f"{name}/1x1", x, 64, (1, 1))
    b5 = c(f"{name}/5x5", c(f"{name}/5x5_reduce", x, 48, (1, 1)), 64, (5, 5), pad=(2, 2))
    d = c(f"{name}/3x3dbl_reduce", x, 64, (1, 1))
    d = c(f"{name}/3x3dbl_2", c(f"{name}/3x3dbl_1", d, 96, (3, 3), pad=(1, 1)), 96, (3, 3), pad=(1, 1))
    bp = c(f"{name}/pool_proj", b.pool(f"{name}/pool", x, P.Pooling.AVE, 3, 1, 1), pool_features, (1, 1))
    return b.concat(f"{name}/output", [b1, b5, d, bp])


def module_b(b: _Builder, name: str, x):
    """35x35 → 17x17: 3x3/2 | 1x1→3x3→3x3/2 | max pool/2."""
    c = b.conv
    b3 = c(f"{name}/3x3", x, 384, (3, 3), stride=2)
    d = c(f"{name}/3x3dbl_1", c(f"{name}/3x3dbl_reduce", x, 64, (1, 1)), 96, (3, 3), pad=(1, 1))
    d = c(f"{name}/3x3dbl_2", d, 96, (3, 3), stride=2)
    return b.concat(f"{name}/output", [b3, d, b.pool(f"{name}/pool", x, P.Pooling.MAX, 3, 2)])


def module_c(b: _Builder, name: str, x, c7: int):
    """17x17: 1x1 | 1x1→1x7→7x1 | 1x1→7x1→1x7→7x1→1x7 | avg pool→1x1."""
    c = b.conv
    b1 = c(f"{name}/1x1", x, 192, (1, 1))
    s = c(f"{name}/7x7_reduce", x, c7, (1, 1))
    s = c(f"{name}/7x7_2", c(f"{name}/7x7_1", s, c7, (1, 7), pad=(0, 3)), 192, (7, 1), pad=(3, 0))
    d = c(f"{name}/7x7dbl_reduce", x, c7, (1, 1))
    for i, (kernel, out) in enumerate((((7, 1), c7), ((1, 7), c7), ((7, 1), c7), ((1, 7), 192)), 1):
        d = c(f"{name}/7x7dbl_{i}", d, out, kernel, pad=(kernel[0] // 2, kernel[1] // 2))
    bp = c(f"{name}/pool_proj", b.pool(f"{name}/pool", x, P.Pooling.AVE, 3, 1, 1), 192, (1, 1))
    return b.concat(f"{name}/output", [b1, s, d, bp])


def module_d(b: _Builder, name: str, x):
    """17x17 → 8x8: 1x1→3x3/2 | 1x1→1x7→7x1→3x3/2 | max pool/2."""
    c = b.conv
    b3 = c(f"{name}/3x3", c(f"{name}/3x3_reduce", x, 192, (1, 1)), 320, (3, 3), stride=2)
    s = c(f"{name}/7x7x3_reduce", x, 192, (1, 1))
    s = c(f"{name}/7x7x3_2", c(f"{name}/7x7x3_1", s, 192, (1, 7), pad=(0, 3)), 192, (7, 1), pad=(3, 0))
    s = c(f"{name}/7x7x3_3", s, 192, (3, 3), stride=2)
    return b.concat(f"{name}/output", [b3, s, b.pool(f"{name}/pool", x, P.Pooling.MAX, 3, 2)])


def module_e(b: _Builder, name: str, x):
    """8x8: 1x1 | 1x1→(1x3, 3x1) | 1x1→3x3→(1x3, 3x1) | avg pool→1x1."""
    c = b.conv
    b1 = c(f"{name}/1x1", x, 320, (1, 1))
    s = c(f"{name}/3x3_reduce", x, 384, (1, 1))
    s1, s2 = c(f"{name}/3x3_1x3", s, 384, (1, 3), pad=(0, 1)), c(f"{name}/3x3_3x1", s, 384, (3, 1), pad=(1, 0))
    d = c(f"{name}/3x3dbl_1", c(f"{name}/3x3dbl_reduce", x, 448, (1, 1)), 384, (3, 3), pad=(1, 1))
    d1, d2 = c(f"{name}/3x3dbl_1x3", d, 384, (1, 3), pad=(0, 1)), c(f"{name}/3x3dbl_3x1", d, 384, (3, 1), pad=(1, 0))
    bp = c(f"{name}/pool_proj", b.pool(f"{name}/pool", x, P.Pooling.AVE, 3, 1, 1), 192, (1, 1))
    return b.concat(f"{name}/output", [b1, s1, s2, d1, d2, bp])


def inception_v3(batch: int = 10):
    """The deploy NetParameter."""
    b = _Builder(batch)
    c = b.conv
    x = c("conv1_3x3_s2", b.n.data, 32, (3, 3), stride=2)              # 149x149x32
    x = c("conv2_3x3", x, 32, (3, 3))                                  # 147x147x32
    x = c("conv3_3x3", x, 64, (3, 3), pad=(1, 1))                      # 147x147x64
    x = b.pool("pool1_3x3_s2", x, P.Pooling.MAX, 3, 2)                 # 73x73x64
    x = c("conv4_1x1", x, 80, (1, 1))                                  # 73x73x80
    x = c("conv5_3x3", x, 192, (3, 3))                                 # 71x71x192
    x = b.pool("pool2_3x3_s2", x, P.Pooling.MAX, 3, 2)                 # 35x35x192
    for name, features in (("mixed_5b", 32), ("mixed_5c", 64), ("mixed_5d", 64)):
        x = module_a(b, name, x, features)                             # 35x35x256, x288, x288
    x = module_b(b, "mixed_6a", x)                                     # 17x17x768
    for name, c7 in (("mixed_6b", 128), ("mixed_6c", 160), ("mixed_6d", 160), ("mixed_6e", 192)):
        x = module_c(b, name, x, c7)                                   # 17x17x768
    x = module_d(b, "mixed_7a", x)                                     # 8x8x1280
    x = module_e(b, "mixed_7b", x)                                     # 8x8x2048
    x = module_e(b, "mixed_7c", x)                                     # 8x8x2048
    n = b.n
    n.pool3_8x8 = L.Pooling(x, pool=P.Pooling.AVE, kernel_size=8, stride=1)
    n.drop = L.Dropout(n.pool3_8x8, dropout_ratio=0.2, in_place=True)
    n.classifier = L.InnerProduct(n.pool3_8x8, num_output=1000)
    n.prob = L.Softmax(n.classifier)
    proto = n.to_proto()
    proto.name = "Inception-v3"
    return proto


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = ("# Inception-v3 (Szegedy et al. 2016), deploy net: 299x299 input, BatchNorm + Scale + ReLU after every\n"
              "# convolution.  Generated by tools/make_inception_v3.py; edit that script, not this file.\n")
    out.write_text(header + str(inception_v3(args.batch)))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
