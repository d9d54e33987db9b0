"""Sliding-window inference of large volumes (ZNNi)."""
