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
"""

from __future__ import annotations

import inspect
import os

_FN = "torch_chunk_gated_delta_rule"


def _bound(module):
    """(the function transformers bound, its PyTorch reference)."""
    fn = getattr(module, _FN)
    return fn, inspect.unwrap(fn)


def _implementation(fn) -> object | None:
    """The non-reference implementation a transformers wrapper calls, if any (its closure's `implementation`)."""
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__))
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
