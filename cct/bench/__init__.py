"""Measuring nets: Caffe's per-layer ``time`` loop (:mod:`cct.bench.timing`), FLOP counts per layer
(:mod:`cct.bench.flops`) and ``cct bench``'s throughput, % of peak, price per image and reports
(:mod:`cct.bench.bench`)."""
