"""Executors: how a net's forward and backward passes run.  The device split (:mod:`cct.exec.device_split`)
runs each batch-separable layer on per-device shares of the batch."""
