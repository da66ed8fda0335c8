"""What each build op accepts in a step's `with`: every key's type and values, checked when the recipe is
loaded, so that a wrong value in the last step is refused before the first step runs (and by --dry-run,
which plans only the steps whose inputs exist), naming the step and the key, never a traceback mid-build.

The values are the ops' own: the enums and parsers their options and CLI flags use.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cache

from qtool.formats.naming import Flavour
from qtool.io.files import LinkMode
from qtool.io.writer import parse_size
from qtool.ops.assemble.model import MtpMode
from qtool.ops.patch_config import Fix
from qtool.ops.verify import KV_CACHE_DTYPES, parse_engines
from qtool.ops.verify.memory_fit import Target
from qtool.recipes import Backend, OutFormat


class Op(str, Enum):
    DOWNLOAD = "download"
    QUANTIZE = "quantize"
    CONVERT = "convert"
    ASSEMBLE = "assemble"
    CALIBRATE_KV = "calibrate-kv"
    PATCH_CONFIG = "patch-config"
    VERIFY = "verify"


# The `with` keys that name a step's inputs (sources or earlier steps), per op; other ops take `input`.
INPUT_KEYS: dict[Op, tuple[str, ...]] = {Op.ASSEMBLE: ("bf16", "nvfp4")}
# The `with` keys an op cannot do without (its options have no default for them).
REQUIRED_KEYS: dict[Op, tuple[str, ...]] = {Op.QUANTIZE: ("recipe",), Op.CONVERT: ("to",)}


@dataclass(frozen=True)
class Check:
    """One `with` key's rule: what the error says is expected, and the test."""

    expected: str
    ok: Callable[[object], bool]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # YAML's true is no count


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _parses(parse: Callable[[str], object]) -> Callable[[object], bool]:
    """A text value that the op's own parser accepts."""

    def ok(value) -> bool:
        if not isinstance(value, str):
            return False
        try:
            parse(value)
        except Exception:  # noqa: BLE001 - whatever the parser refuses with, the check names the key
            return False
        return True

    return ok


def choice(values) -> Check:
    allowed = [getattr(v, "value", v) for v in values]
    return Check("one of " + ", ".join(allowed), lambda v: isinstance(v, str) and v in allowed)


def list_of(item: Check) -> Check:
    return Check(
        f"a list, each {item.expected} (a YAML list: [a, b])",
        lambda v: isinstance(v, list) and all(item.ok(x) for x in v),
    )


def or_null(check: Check) -> Check:
    """A key whose option defaults to None: null is that default (the recipe plan hybrid writes has them)."""
    return Check(f"{check.expected}, or null", lambda v: v is None or check.ok(v))


TEXT = Check("a non-empty string", lambda v: isinstance(v, str) and v != "")
FLAG = Check("true or false", lambda v: isinstance(v, bool))
COUNT = Check("an integer >= 1", lambda v: _is_int(v) and v >= 1)
NON_NEGATIVE = Check("an integer >= 0", lambda v: _is_int(v) and v >= 0)
POSITIVE = Check("a number > 0", lambda v: _is_number(v) and v > 0)
FRACTION = Check("a number > 0 and <= 1", lambda v: _is_number(v) and 0 < v <= 1)
DEVICE = Check("cpu, cuda or cuda:N", lambda v: isinstance(v, str) and re.fullmatch(r"cpu|cuda(:\d+)?", v) is not None)
LAYERS = list_of(NON_NEGATIVE)


def _size_ok(value) -> bool:
    return (_is_int(value) and value >= 1) or (_parses(parse_size)(value) and parse_size(value) >= 1)


SIZE = Check("a size: a byte count or text like 5GB, 500MB, 4GiB", _size_ok)


@cache
def with_schema(op: Op) -> dict[str, Check]:
    """key -> Check of every `with` key `op` accepts (the ops' modules are imported on first use)."""
    calibration = {"samples": COUNT, "seq_len": COUNT, "dataset": TEXT, "device": DEVICE}
    return {
        Op.DOWNLOAD: {"include": list_of(TEXT), "tensors": list_of(TEXT)},
        Op.QUANTIZE: {
            "recipe": TEXT,
            "backend": choice(Backend),
            "format": choice(OutFormat),
            **calibration,
            "samples": or_null(COUNT),
        },
        Op.CONVERT: {"to": choice(Flavour)},
        Op.ASSEMBLE: {
            "nvfp4": TEXT,
            "bf16": TEXT,
            "bf16_expert_layers": LAYERS,
            "bf16_shared_expert_layers": or_null(LAYERS),
            "mtp": choice(MtpMode),
            "max_shard_size": or_null(SIZE),
            # assemble's --link choices: a symlink into the HF cache is download's only
            "link": choice(m for m in LinkMode if m not in (LinkMode.SYMLINK, LinkMode.OWN_INODE)),
        },
        Op.CALIBRATE_KV: {**calibration, "replace_scales": FLAG},
        Op.PATCH_CONFIG: {
            "fixes": list_of(choice(Fix)),
            "ignore_add": list_of(TEXT),
            "ignore_remove": list_of(TEXT),
            "yarn": or_null(POSITIVE),
            "original_max_position": or_null(COUNT),
            "sampling_defaults": FLAG,
        },
        Op.VERIFY: {
            "engine": Check("vllm, sglang, both, or specs like vllm@0.17", _parses(parse_engines)),
            "tp": COUNT,
            "gpus": Check("NxSIZE, e.g. 4x97887MiB or 4x96GiB", _parses(Target.parse)),
            "max_model_len": or_null(COUNT),
            "max_num_seqs": or_null(COUNT),
            "kv_cache_dtype": choice(KV_CACHE_DTYPES),
            "mtp": NON_NEGATIVE,
            "deep": FLAG,
            "gpu_memory_utilization": FRACTION,
        },
    }[op]


def with_problems(op: Op, params: dict) -> list[tuple[str, str, object]]:
    """(key, expected, got) for every `with` value `op` does not accept (unknown keys are the caller's)."""
    schema = with_schema(op)
    return [
        (key, schema[key].expected, value)
        for key, value in params.items()
        if key in schema and not schema[key].ok(value)
    ]
