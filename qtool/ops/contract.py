"""The one op contract (docs/design.md "Shapes every op shares"):

    opts = CalibrateKvOptions(checkpoint=..., samples=16)   # typed, frozen: the only place defaults live
    p = plan(opts)                                           # headers and configs only; all validation
    report = execute(p)                                      # through the output transaction
    report.to_json()

The CLI, the build steps (qtool.ops.pipeline.steps: a table of {op: OpSpec}) and library callers all
construct the options; `options_from` makes them from a build step's `with` section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qtool.errors import UsageError


@dataclass
class Report:
    """What an op's execute() returns."""

    data: dict

    def to_json(self) -> dict:
        return self.data


@dataclass(frozen=True)
class OpSpec:
    """One row of the build runner's table: the op's options type and its plan / execute functions."""

    options: type
    plan: Callable[[Any], Any]
    execute: Callable[..., Report]


def options_from(cls: type, params: dict, **fixed) -> Any:
    """`cls` (an options dataclass) from a build step's `with` keys (already checked against the recipe
    schema) plus the values the runner fixes (input paths, output dir, force, resume, command)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - names)
    if unknown:
        raise UsageError(
            f"unknown option(s) for {cls.__name__}: {', '.join(unknown)}", expected=", ".join(sorted(names))
        )
    return cls(**{**params, **fixed})
