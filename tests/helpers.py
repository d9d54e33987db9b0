"""Helpers shared by test modules."""
from __future__ import annotations

from cct.config import settings


def use_flags(lowering: str | None = None, partitions: str | None = None, conv_engine: str | None = None) -> None:
    """What ``-lowering``, ``-partitions`` and ``-conv_engine`` on the command line do (None: not given)."""
    settings.apply_flags({"lowering": lowering or "", "partitions": partitions or "", "conv_engine": conv_engine or ""})
    settings.validate()
