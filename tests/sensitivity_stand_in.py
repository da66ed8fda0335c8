"""A sensitivity table for a sparse real-scale pair (real headers, holes for data): the units and their
costs from the headers, as `qtool sensitivity` lists them; the effects are stand-ins (a real run needs the
weights), made so that the planner's choice is known: later layers matter more, a shared expert 3x its
size's worth."""

from __future__ import annotations

import json
from pathlib import Path


def stand_in_effect(u) -> float:
    return (u.layer + 1) * (3.0 if u.kind == "shared_expert" else 1.0) * 1e-4


def write_stand_in_table(bf16: Path, quantized: Path, out: Path) -> list:
    """OUT/sensitivity.json for the pair; returns the units."""
    from qtool.arch.model_map import build_map
    from qtool.io.checkpoint import Checkpoint
    from qtool.ops.sensitivity import FORMAT, SCHEMA_VERSION, TABLE, model_shape
    from qtool.ops.sensitivity.units import TP_SIZES, list_units

    units = list_units(build_map(Checkpoint.open(bf16)), build_map(Checkpoint.open(quantized)))
    for u in units:
        if u.quantized and u.layer is not None:
            u.measured, u.error, u.effect = True, 0.01, stand_in_effect(u)
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "schema_version": SCHEMA_VERSION,
                "bf16": {"path": str(bf16)},
                "quantized": {"path": str(quantized)},
                "model": model_shape(Checkpoint.open(bf16)),
                "tp_sizes": list(TP_SIZES),
                "calibration": {"dataset": "builtin", "samples": 16, "seq_len": 2048},
                "units": [u.to_json() for u in units],
            }
        )
    )
    return units
