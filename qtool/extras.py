"""The optional dependencies (pyproject's extras): one check before any work, one error that names the
extra to install, instead of a ModuleNotFoundError traceback halfway through a run."""

from __future__ import annotations

import importlib.util

from qtool.errors import PlanError

# module -> (its distribution, the qtool extra that installs it)
PROVIDERS = {
    "modelopt": ("nvidia-modelopt", "quant"),
    "llmcompressor": ("llmcompressor", "quant"),
    "compressed_tensors": ("compressed-tensors", "quant"),
    "datasets": ("datasets", "data"),
}


def require(module: str, purpose: str) -> None:
    """Raise a PlanError naming `pip install 'qtool[EXTRA]'` when `module` cannot be imported."""
    if importlib.util.find_spec(module) is not None:
        return
    dist, extra = PROVIDERS[module]
    raise PlanError(
        f"{purpose} needs {dist}, which is not installed", hint=f"pip install 'qtool[{extra}]' (or: pip install {dist})"
    )
