"""Logging in glog's format, as Caffe writes it.

Every line is ``<S><MMDD> <HH:MM:SS.uuuuuu> <thread id, width 5> <file>:<line>] <message>`` with S in
I/W/E/F, so Caffe's log tools (``parse_log.py``, ``parse_log.sh``) read our logs.  Like glog without
``InitGoogleLogging`` everything goes to stderr; ``GLOG_minloglevel`` (0 INFO, 1 WARNING, 2 ERROR,
3 FATAL) is honoured, as pycaffe users expect.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading

logger = logging.getLogger("cct")

_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}
_LETTER = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E",
           logging.CRITICAL: "F"}


class GlogFormatter(logging.Formatter):
    """Formats a record as one glog line."""

    def format(self, record: logging.LogRecord) -> str:
        t = datetime.datetime.fromtimestamp(record.created)
        letter = _LETTER.get(record.levelno, "I")
        tid = threading.get_native_id() if record.thread == threading.get_ident() else record.thread
        prefix = (f"{letter}{t.month:02d}{t.day:02d} {t.hour:02d}:{t.minute:02d}:{t.second:02d}."
                  f"{t.microsecond:06d} {tid % 100000:5d} {record.filename}:{record.lineno}] ")
        return prefix + record.getMessage()


def _min_level() -> int:
    try:
        return _LEVELS.get(int(os.environ.get("GLOG_minloglevel", "0")), logging.INFO)
    except ValueError:
        return logging.INFO


def init_log(level: int | None = None, stream=None) -> None:
    """(Re)install the stderr handler.  ``level`` is a glog level (0..3); default from GLOG_minloglevel."""
    for h in list(logger.handlers):
        if getattr(h, "_cct_glog", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(GlogFormatter())
    handler._cct_glog = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(_LEVELS.get(level, logging.INFO) if level is not None else _min_level())
    logger.propagate = False


def fmt(x: float) -> str:
    """A float as C++ ostream prints it by default (``%g``, 6 significant digits)."""
    return "%g" % float(x)


debug = logger.debug  # Caffe's DLOG(INFO): printed by debug builds only, so not by default
info = logger.info
warning = logger.warning
error = logger.error

init_log()


class _CallableModule(type(sys)):
    """Lets ``caffe.log("message")`` (pycaffe's function) and ``cct.log.info(...)`` both work."""

    def __call__(self, message: str) -> None:
        logger.info("%s", message, stacklevel=2)


sys.modules[__name__].__class__ = _CallableModule
