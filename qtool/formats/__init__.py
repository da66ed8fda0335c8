"""Pure tensor codecs (no file IO): NVFP4, FP8, AWQ / compressed-tensors INT4, and the naming of
their tensors in each checkpoint flavour.

Submodules import torch; this package file does not, so `qtool.formats.naming` stays cheap to import
for commands that only read headers.
"""

from __future__ import annotations

from qtool.errors import QtoolError


class CodecError(QtoolError, ValueError):
    """A tensor that a codec cannot encode or decode (wrong shape, dtype or divisibility)."""


__all__ = ["CodecError"]
