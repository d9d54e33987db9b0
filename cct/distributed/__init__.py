"""Data-parallel training: solver replicas that exchange gradients every iteration
(:mod:`cct.distributed.replicas`: one replica per device in threads, Caffe's ``-gpu 0,1``)."""
