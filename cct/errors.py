"""User-facing errors.

Everything a user can get wrong (a file, a net definition, a layer parameter, a weight file) raises a
:class:`CctError` whose message is one complete line naming what is wrong and where.  The command line
prints that line and exits non-zero; the Python API lets it propagate.
"""
from __future__ import annotations


class CctError(Exception):
    """A problem with user input, reported as one line (file, layer, field, what is wrong)."""


class ParamError(CctError):
    """An invalid layer parameter.  ``field`` is the dotted prototxt field, e.g. ``convolution_param.stride``.

    Layers raise it without knowing their file or name; the net builder prefixes both.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)


def check(condition: bool, field: str, message: str) -> None:
    """Raise :class:`ParamError` unless ``condition`` holds (Caffe's CHECK, as a user error)."""
    if not condition:
        raise ParamError(field, message)
