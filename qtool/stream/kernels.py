"""Which Gated-DeltaNet kernel computes a streamed layer's linear-attention mixer, and the choice per device.

transformers binds, when its Qwen3.5-MoE modeling module is imported, flash-linear-attention's Triton
kernel for `torch_chunk_gated_delta_rule` if the `fla` package (`fla-core`, qtool's `gpu` extra) imports,
else its PyTorch reference (integrations/hub_kernels.py `use_kernel_func_from_hub_with_fallback`; on a 397B
layer of 16 x 2048 tokens the mixer takes 0.080 s in PyTorch, 0.033 s with fla-core 0.6.0 on an H200).
The binding ignores the device, and fla's kernels run on CUDA tensors only, so:

- on CPU the PyTorch reference is used whatever is installed (the module's function is rebound to it);
- `QTOOL_GDN_KERNEL=torch` asks for the reference on CUDA too (to compare, or to reproduce an old run);
- the kernel used is recorded in the manifest (`kernels.gated_deltanet`): it produced the hidden states the
  calibrated scales come from, and two kernels round differently.

transformers' binding imports `fla`, then `fla.ops.gated_delta_rule`. fla-core's `fla.ops` package imports
every one of its ~40 op families, and its `fla.modules` (which the Gated-DeltaNet kernel's l2norm is in)
imports its activations, which import torch._inductor's compile_fx: 1.7 s of the decoder module's import on
the 2-core VM (0.2 s without them, `python -X importtime`), on the critical path before a streamed job's first
layer. `import_gdn_kernel_alone` imports the kernel's own modules first, under those packages with their
`__init__` not run, and transformers then finds the same functions there.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_FN = "torch_chunk_gated_delta_rule"
# what transformers' Qwen3.5-MoE module imports from fla (hub_kernels' _KERNELS_INTERNAL_PATH_MAPPINGS)
GDN_MODULE = "fla.ops.gated_delta_rule"
# packages on that module's import path whose __init__ imports much more than it uses (outermost first)
UNOPENED_PACKAGES = ("fla.ops", "fla.modules", "fla.modules.norm")


def import_gdn_kernel_alone() -> bool:
    """Import fla's Gated-DeltaNet module without the rest of fla-core (above); True where it did. Where
    fla is not installed, is imported already, or is laid out otherwise (a version whose kernel needs
    what a skipped `__init__` defines), nothing is left behind and transformers imports fla as it would.

    The packages in UNOPENED_PACKAGES are created as packages (their submodules import from their
    folders) without running their `__init__`: `from fla.ops import chunk_gla` would fail in this process,
    and nothing in a streamed job does that; attribute access to the kernel (`fla.ops.gated_delta_rule`)
    is what transformers uses."""
    try:
        if importlib.util.find_spec("fla") is None:
            return False
        if importlib.util.find_spec("torch_npu") is not None:
            return False  # `fla.modules.norm`'s __init__ registers the Ascend NPU kernels (its l2norm's too)
    except (ImportError, ValueError):
        return False
    before = set(sys.modules)
    try:
        import fla  # noqa: F401 -- fla-core's own __init__ is small; the full flash-linear-attention's is not

        if any(name in sys.modules for name in UNOPENED_PACKAGES):
            return False  # imported whole already (by fla's own __init__, or earlier): nothing to save
        for name in UNOPENED_PACKAGES:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.submodule_search_locations is None:
                raise ImportError(f"{name} is not a package here")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
        importlib.import_module(GDN_MODULE)
        return True
    except Exception:  # noqa: BLE001 -- undone below; transformers' own import then reports what is wrong
        # fla's modules only: what else got imported meanwhile (triton, torch._dynamo) is whole and stays (a
        # second copy of a torch module, imported again later, would not share the first one's state)
        ours = [n for n in set(sys.modules) - before if n == "fla" or n.startswith("fla.")]
        for name in sorted(ours, reverse=True):  # children before their parents
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is sys.modules[name]:
                delattr(sys.modules[parent], child)
            del sys.modules[name]
        importlib.invalidate_caches()
        return False


def _bound(module: ModuleType) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(the function transformers bound, its PyTorch reference)."""
    fn = getattr(module, _FN)
    return fn, inspect.unwrap(fn)


def _implementation(fn: Callable[..., Any]) -> object | None:
    """The non-reference implementation a transformers wrapper calls, if any (its closure's `implementation`)."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__, strict=True))
    impl = cells.get("implementation")
    return impl.cell_contents if impl is not None else None


def select_gdn_kernel(device: str) -> str:
    """Bind the kernel for `device` in transformers' modeling module; returns what the manifest records:
    'fla-core <version>' or 'torch'."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    if not hasattr(m, "_qtool_gdn_fast"):
        fn, ref = _bound(m)
        impl = _implementation(fn)
        m._qtool_gdn_fast = fn if impl is not None and str(getattr(impl, "__module__", "")).startswith("fla") else None
        m._qtool_gdn_ref = ref
    fast = m._qtool_gdn_fast
    use_fast = fast is not None and device != "cpu" and os.environ.get("QTOOL_GDN_KERNEL", "") != "torch"
    setattr(m, _FN, fast if use_fast else m._qtool_gdn_ref)
    if not use_fast:
        return "torch"
    from importlib import metadata

    try:
        return f"fla-core {metadata.version('fla-core')}"
    except metadata.PackageNotFoundError:
        return "fla"
