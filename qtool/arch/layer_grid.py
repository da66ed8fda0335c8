"""A checkpoint as a layer x module-group grid: for each decoder layer (and the MTP layer) the storage
format of its attention / Gated DeltaNet projections, router, shared expert and routed experts; for the
model as a whole the embedding, lm_head and vision tower.

`inspect --json` prints it (`grid`) and `qtool report` draws it, so both show the same object. Norms,
biases-only modules and KV scales carry no storage format and are left out (KV scales have their own
section). `cell_of` places a module name (e.g. a verify finding's) in the same grid.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from qtool.arch.model_map import ModelMap
from qtool.arch.qwen35 import Group, Naming, classify

# column -> the module groups (`Module.inner`) drawn in it. The shared-expert gate is a one-row Linear
# that both engines keep replicated next to the router (vLLM models/qwen3_next.py ReplicatedLinear), so it
# sits in the router column rather than making every quantized shared expert look "mixed".
COLUMNS: dict[str, tuple[Group, ...]] = {
    "attention": (Group.ATTENTION, Group.LINEAR_ATTN),
    "router": (Group.ROUTER, Group.SHARED_EXPERT_GATE),
    "shared_expert": (Group.SHARED_EXPERT,),
    "routed_experts": (Group.ROUTED_EXPERTS,),
    "other": (Group.MTP, Group.OTHER),  # mtp.fc and anything the architecture map does not name
}
MODEL_COLUMNS: dict[str, Group] = {"embed": Group.EMBED, "lm_head": Group.LM_HEAD, "vision": Group.VISION}
MTP_ROW = "mtp"
_COLUMN_OF = {g: col for col, groups in COLUMNS.items() for g in groups}


def _cell(formats: Counter, nbytes: int) -> dict:
    fmt = next(iter(formats)) if len(formats) == 1 else "mixed"
    return {"format": fmt, "formats": dict(sorted(formats.items())), "modules": sum(formats.values()), "bytes": nbytes}


def row_name(layer: int | None, mtp: bool) -> str:
    return MTP_ROW if mtp else f"layer {layer}"


def cell_of(module: str, naming: Naming) -> tuple[str, str] | None:
    """(row, column) of a module name in the grid: ("layer 3", "routed_experts"), ("model", "embed"), or
    None for a name the grid has no cell for (a shard, a config key, a KV scale)."""
    role = classify(module + ".weight", naming)
    return _place(role.group, role.inner, role.layer)


def _place(group: Group, inner: Group, layer: int | None) -> tuple[str, str] | None:
    for col, model_group in MODEL_COLUMNS.items():
        if group is model_group:
            return ("model", col)
    col = _COLUMN_OF.get(inner)
    mtp = group is Group.MTP
    if col is None or (layer is None and not mtp):
        return None
    return (row_name(layer, mtp), col)


def layer_grid(mm: ModelMap) -> dict:
    """{"columns", "rows": [{"row", "layer", "type", "expert_layout", "cells": {column: cell}}], "model": {column:
    cell}}; a cell is {"format", "formats": {format: modules}, "modules", "bytes"}."""
    formats: dict[tuple[str, str], Counter] = defaultdict(Counter)
    nbytes: dict[tuple[str, str], int] = defaultdict(int)
    for m in mm.modules.values():
        if m.format is None:
            continue
        key = _place(m.group, m.inner, m.layer)
        if key is None:
            continue
        formats[key][m.format.value] += 1
        nbytes[key] += m.nbytes()
    rows = []
    types = mm.layer_types or []
    n = max([mm.num_layers] + [m.layer + 1 for m in mm.modules.values() if m.layer is not None and not m.is_mtp])
    for layer in range(n):
        name = row_name(layer, False)
        rows.append(
            {
                "row": name,
                "layer": layer,
                "type": types[layer] if layer < len(types) else None,
                "expert_layout": mm.layer_expert_layout.get(layer),
                "cells": {c: _cell(formats[(name, c)], nbytes[(name, c)]) for c in COLUMNS if (name, c) in formats},
            }
        )
    if any(r == MTP_ROW for r, _ in formats):
        rows.append(
            {
                "row": MTP_ROW,
                "layer": None,
                "type": "full_attention",
                "expert_layout": mm.mtp_expert_layout,
                "cells": {
                    c: _cell(formats[(MTP_ROW, c)], nbytes[(MTP_ROW, c)]) for c in COLUMNS if (MTP_ROW, c) in formats
                },
            }
        )
    model = {c: _cell(formats[("model", c)], nbytes[("model", c)]) for c in MODEL_COLUMNS if ("model", c) in formats}
    return {"columns": list(COLUMNS), "model_columns": list(MODEL_COLUMNS), "rows": rows, "model": model}
