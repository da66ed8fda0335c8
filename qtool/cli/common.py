"""Small helpers shared by the command modules (output only; no logic)."""

from __future__ import annotations

import json
import sys


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def eprint(*args) -> None:
    print(*args, file=sys.stderr)
