"""The sensitivity table's schema, checked where it is read (load_table: plan hybrid and report).

A table is a JSON file a person can edit, copy or truncate; every value the planner does arithmetic on
has its type, sign and finiteness checked here, and a wrong one is named by file, row and key (a
negative effect made a negative predicted error; a string or a boolean became a traceback or a silent 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from qtool.errors import PlanError
from qtool.ops.sensitivity.formats import Candidate
from qtool.recipes import GROUP_SCHEMES, WeightScale

Rule = tuple[Callable[[object], bool], str]


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


TEXT: Rule = (lambda v: isinstance(v, str), "a string")
FLAG: Rule = (lambda v: isinstance(v, bool), "true or false")
COUNT: Rule = (lambda v: _whole(v) and v >= 0, "a whole number >= 0")
LAYER: Rule = (lambda v: v is None or (_whole(v) and v >= 0), "a layer number >= 0, or null")
MEASURE: Rule = (lambda v: v is None or (_real(v) and v >= 0), "a finite number >= 0, or null")
# a unit missing from the BF16 side costs less than nothing: the extra bytes may be negative, never fractional
BYTES_BY_TP: Rule = (
    lambda v: isinstance(v, dict) and all(k.isdigit() and _whole(x) for k, x in v.items()),
    'an object of TP size -> whole bytes, e.g. {"1": 4096, "2": 2048}',
)
TP_SIZES: Rule = (
    lambda v: isinstance(v, list) and bool(v) and all(_whole(t) and t >= 1 for t in v),
    "a list of TP sizes >= 1",
)
SOURCE: Rule = (
    lambda v: isinstance(v, dict) and isinstance(v.get("path"), str) and bool(v["path"]),
    'an object with a "path" string',
)
OBJECT_OR_NULL: Rule = (lambda v: v is None or isinstance(v, dict), "an object or null")
POSITIVE_OR_NULL: Rule = (lambda v: v is None or (_whole(v) and v >= 1), "a whole number >= 1, or null")
TEXT_OR_NULL: Rule = (lambda v: v is None or isinstance(v, str), "a string or null")

KNOWN_FORMATS = [c.value for c in Candidate]
CANDIDATES: Rule = (
    lambda v: isinstance(v, list) and bool(v) and all(x in KNOWN_FORMATS for x in v) and len(set(v)) == len(v),
    f"a list of distinct formats of {KNOWN_FORMATS}",
)
METHODS = [m.value for m in WeightScale]
NVFP4_METHOD: Rule = (
    lambda v: isinstance(v, dict) and v.get("weight_scale") in METHODS,
    f'an object {{"weight_scale": one of {METHODS}}}',
)
OBJECT: Rule = (lambda v: isinstance(v, dict), "an object")
GROUP: Rule = (lambda v: v in GROUP_SCHEMES, f"a recipe group of {sorted(GROUP_SCHEMES)}")
MEASURED: Rule = (lambda v: _real(v) and v >= 0, "a finite number >= 0 (a measured format)")

# key -> (rule, required)
TOP = {
    "bf16": (SOURCE, True),
    "quantized": (SOURCE, True),
    "tp_sizes": (TP_SIZES, True),
    "units": ((lambda v: isinstance(v, list), "a list of unit rows"), True),
    "calibration": (OBJECT_OR_NULL, False),
    "model": (OBJECT_OR_NULL, False),
}
CALIBRATION = {
    "samples": (POSITIVE_OR_NULL, False),
    "seq_len": (POSITIVE_OR_NULL, False),
    "dataset": (TEXT_OR_NULL, False),
}
# one row of qtool.ops.sensitivity.units.Unit.to_json
UNIT = {
    "id": (TEXT, True),
    "kind": (TEXT, True),
    "layer": (LAYER, True),
    "quantized_format": (TEXT, True),
    "bf16_bytes": (COUNT, True),
    "quantized_bytes": (COUNT, True),
    "extra_bytes_per_gpu": (BYTES_BY_TP, True),
    "spliceable": (FLAG, True),
    "measured": (FLAG, True),
    "error": (MEASURE, False),
    "effect": (MEASURE, False),
    "tokens": (COUNT, False),
    "note": (TEXT, False),
    "quantized": (FLAG, False),
}


# schema 2 (--formats): the candidates, and per layer unit one row per format it takes
FORMATS = {
    "candidates": (CANDIDATES, True),
    "nvfp4": (NVFP4_METHOD, True),
}
FORMAT_ROW = {
    "bytes": (COUNT, True),
    "extra_bytes_per_gpu": (BYTES_BY_TP, True),
    "error": (MEASURED, True),
    "effect": (MEASURED, True),
}


def _bad(path: Path, where: str, message: str, got=None) -> PlanError:
    return PlanError(
        f"the sensitivity table is not valid: {where} {message}",
        path=path,
        got=None if got is None else f"{type(got).__name__} {got!r}"[:200],
        hint=f"fix {where} in {path.name}, or make the table again: qtool sensitivity BF16 QUANTIZED -o OUT",
    )


def _check(path: Path, obj: dict, prefix: str, rules: dict) -> None:
    for key, ((ok, want), required) in rules.items():
        if key not in obj:
            if required:
                raise _bad(path, f"{prefix}{key}", "is missing")
        elif not ok(obj[key]):
            raise _bad(path, f"{prefix}{key}", f"must be {want}", obj[key])


def check_table(data: dict, path: Path) -> None:
    """A named PlanError (the file, the row, the key) for the first value the schema refuses."""
    _check(path, data, "", TOP)
    _check(path, data.get("calibration") or {}, "calibration.", CALIBRATION)
    with_formats = data.get("schema_version") == 2
    if with_formats:
        _check(path, data, "", {"formats": (OBJECT, True)})
        _check(path, data["formats"], "formats.", FORMATS)
    tps = {str(t) for t in data["tp_sizes"]}
    for i, row in enumerate(data["units"]):
        if not isinstance(row, dict):
            raise _bad(path, f"units[{i}]", "must be an object (a unit row)", row)
        name = f"units[{i}]" + (f" ({row['id']})" if isinstance(row.get("id"), str) else "") + "."
        _check(path, row, name, UNIT)
        _check_costs(path, f"{name}extra_bytes_per_gpu", row["extra_bytes_per_gpu"], tps)
        if with_formats and "formats" in row:
            _check_format_rows(path, name, row, data["formats"]["candidates"], tps)


def _check_costs(path: Path, where: str, costs: dict, tps: set[str]) -> None:
    lacking = sorted(tps - set(costs), key=int)
    if lacking:
        raise _bad(path, where, f"has no cost at TP {', '.join(lacking)} (the table's tp_sizes)", costs)


def _check_format_rows(path: Path, name: str, row: dict, candidates: list[str], tps: set[str]) -> None:
    """A unit's per-format rows: a recipe group, formats of the table's candidates, each row's numbers."""
    _check(path, row, name, {"group": (GROUP, True), "formats": (OBJECT, True)})
    for fmt, frow in row["formats"].items():
        where = f"{name}formats.{fmt}"
        if fmt not in candidates:
            raise _bad(path, where, f"is not one of the table's formats.candidates {candidates}", fmt)
        if not isinstance(frow, dict):
            raise _bad(path, where, "must be an object (bytes, extra_bytes_per_gpu, error, effect)", frow)
        _check(path, frow, f"{where}.", FORMAT_ROW)
        _check_costs(path, f"{where}.extra_bytes_per_gpu", frow["extra_bytes_per_gpu"], tps)
