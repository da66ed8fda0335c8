"""What both real-loader runners (vllm_load_runner.py, sglang_load_runner.py) record while an engine loads
a checkpoint, so a verdict covers more than "it did not raise":

- every float parameter is filled with NaN before loading; one still (partly) NaN afterwards was never
  (fully) written: a missing expert or scale leaves its slot of a fused parameter empty;
- every checkpoint tensor the loader is handed is watched through a TorchDispatchMode: a tensor no
  data-reading op ever touches (only views of it, or nothing) was dropped silently.

Runs inside QTOOL_ENGINES_PYTHON; kept free of qtool imports.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# attention parameters the engines create with a default that stands for "not in the checkpoint" (vLLM:
# k_scale 1.0 ...; SGLang: -1.0, read as 1.0 by kv_cache.py): checkpoints need not carry them
DEFAULTED = (
    ".attn.q_scale",
    ".attn.prob_scale",
    ".attn.k_scale",
    ".attn.v_scale",
    ".attn.q_zero_point",
    ".attn.k_zero_point",
    ".attn.v_zero_point",
)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr or None


class ConsumptionProbe(TorchDispatchMode):
    """Marks a watched checkpoint tensor consumed when any non-view aten op reads its storage (a copy_ into a
    parameter, a cat of gate and up, a dtype cast before the copy). Views (narrow, view, transpose) share the
    storage, so the op that finally reads a view counts for the tensor it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, str] = {}  # storage pointer -> checkpoint name
        self.consumed: set[str] = set()

    def watch(self, name: str, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None or t.numel() == 0:
            self.consumed.add(name)  # nothing to read (an empty or meta tensor)
        else:
            self.watched[key] = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and self.watched:
            for a in (*args, *kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        name = self.watched.get(_storage_key(t))
                        if name is not None:
                            self.consumed.add(name)
        return func(*args, **kwargs)


def fill_nan(params: dict[str, torch.Tensor], keep) -> None:
    """NaN into every float parameter but those `keep(name)` says the engine defaults (k_scale 1.0 ...)."""
    with torch.no_grad():
        for name, p in params.items():
            if p.dtype.is_floating_point and not keep(name):
                p.fill_(float("nan"))


def unwritten(params: dict[str, torch.Tensor], skip) -> list[str]:
    """Float parameters still holding a NaN, but those `skip(name)` names (defaulted or derived later)."""
    return [
        n for n, p in params.items() if p.dtype.is_floating_point and not skip(n) and bool(torch.isnan(p.float()).any())
    ]


def dropped(seen: list[str], consumed: set[str], mtp: bool) -> list[str]:
    """Tensors of the model being loaded that were never read. The target skips `mtp.*` and the MTP drafter
    everything else, both by design (each checkpoint holds both), so only the loaded model's own count."""
    return sorted({n for n in seen if n.startswith("mtp.") == mtp} - consumed)


def watched_weights(weights, probe: ConsumptionProbe, seen: list[str]):
    """The loader's (name, tensor) stream, each tensor registered with `probe` before the model sees it."""
    for name, t in weights:
        seen.append(name)
        probe.watch(name, t)
        yield name, t


def record_load(
    out: dict, params: dict[str, torch.Tensor], seen: list[str], probe: ConsumptionProbe, mtp: bool, skip
) -> None:
    """After load_weights: how many tensors the engine was handed, which of its own it dropped, which
    parameters (but those `skip(name)` names) it left unwritten; the stage moves on to post-processing."""
    out["tensors"] = len(seen)
    out["dropped"] = dropped(seen, probe.consumed, mtp)
    out["unwritten"] = unwritten(params, skip=skip)
    out["stage"] = "process"


def record_done(out: dict) -> None:
    """After post-processing: the verdict (every parameter written, no tensor of its own dropped)."""
    out["stage"] = "done"
    out["loaded"] = not out["unwritten"] and not out["dropped"]


def new_result() -> dict:
    """A runner's verdict before anything ran (stages: config, build, load, process, done)."""
    return {
        "loaded": False,
        "stage": "config",
        "error": None,
        "tensors": 0,
        "params": 0,
        "unwritten": [],
        "dropped": [],
    }


def record_failure(out: dict, e: Exception) -> None:
    """The engine's refusal, in its own words."""
    out["error"] = f"{type(e).__name__}: {e}"[:2000]
    out["trace"] = traceback.format_exc()[-3000:]


def main(load) -> None:
    """`runner.py CKPT [mtp]`: one QTOOL-ORACLE JSON line (test_loaders.py reads it among the engine's logs)."""
    print("QTOOL-ORACLE " + json.dumps(load(sys.argv[1], mtp=sys.argv[2:] == ["mtp"])))
