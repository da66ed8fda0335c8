"""Typed errors. Library code raises these; the CLI formats them (what, where, expected vs got, fix).

Exit codes (docs/design.md): 0 ok, 1 error, 2 usage, 3 verification failed.
"""

from __future__ import annotations

from pathlib import Path


class QtoolError(Exception):
    """A user-facing error: carries where it happened and how to fix it."""

    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        tensor: str | None = None,
        expected: object = None,
        got: object = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.expected = expected
        self.got = got
        self.hint = hint

    def describe(self) -> str:
        """Multi-line human description used by the CLI."""
        lines = [f"error: {self.message}"]
        if self.path:
            lines.append(f"  file:     {self.path}")
        if self.tensor:
            lines.append(f"  tensor:   {self.tensor}")
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.got is not None:
            lines.append(f"  got:      {self.got}")
        if self.hint:
            lines.append(f"  fix:      {self.hint}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "path": self.path,
            "tensor": self.tensor,
            "expected": None if self.expected is None else str(self.expected),
            "got": None if self.got is None else str(self.got),
            "hint": self.hint,
        }


class UsageError(QtoolError):
    """Bad command-line arguments or options that contradict each other."""

    exit_code = 2


class CheckpointError(QtoolError):
    """A checkpoint directory or file that cannot be used (missing, malformed, inconsistent)."""


class HeaderError(CheckpointError):
    """A safetensors header that is malformed or does not match its file."""


class ConfigError(CheckpointError):
    """config.json / hf_quant_config.json / generation_config.json missing or malformed."""


class PlanError(QtoolError):
    """The requested operation cannot be planned (wrong model, mismatched sources, missing tensors)."""


class WriteError(QtoolError):
    """Writing the output failed (disk full, existing output, permissions)."""


class VerificationError(QtoolError):
    """An artifact failed verification."""

    exit_code = 3


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, or a stop asked of long work (a shard's copy, once another shard failed or the run was
    interrupted), with what was running when it came (e.g. a build step), for the CLI's message."""

    def __init__(self, during: str) -> None:
        super().__init__(during)
        self.during = during
