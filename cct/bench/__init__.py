"""Measuring nets: Caffe's per-layer ``time`` loop (:mod:`cct.bench.timing`)."""
