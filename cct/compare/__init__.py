"""Comparing cct's numbers with a reference (real Caffe's outputs, numerical gradients) under one rule:
:mod:`cct.compare.tolerance`."""
from cct.compare.tolerance import ATOL, RTOL, Comparison, allowance, assert_close, blob_scale, compare_arrays

__all__ = ["ATOL", "RTOL", "Comparison", "allowance", "assert_close", "blob_scale", "compare_arrays"]
