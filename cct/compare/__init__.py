"""Comparing cct's numbers with a reference (real Caffe's outputs, numerical gradients) under one rule:
:mod:`cct.compare.tolerance`; ``cct compare`` against a reference file written by Caffe:
:mod:`cct.compare.reference`."""
from cct.compare.tolerance import ATOL, RTOL, Comparison, allowance, assert_close, blob_scale, compare_arrays

__all__ = ["ATOL", "RTOL", "Comparison", "allowance", "assert_close", "blob_scale", "compare_arrays"]
