"""Compile a qtool Triton kernel for a Hopper GPU (sm_90) without one: Triton's own compiler and the ptxas
its package carries turn the kernel into machine code here, so a kernel that would not compile on the
users' GPUs fails a test on any machine with triton installed, not at a user's first GPTQ run."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import pytest


def compile_for_hopper(kernel: Any, body: Callable, constexprs: dict[str, Any], pointers: dict[str, str]) -> Any:
    """The compiled kernel (its `asm` holds the PTX and the cubin): `kernel` is triton.jit(body); every
    parameter named in `constexprs` takes that value, one named in `pointers` that pointer type ("*fp32",
    "*u8", ...), any other `..._ptr` is *fp32 and the rest int32."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 makes every kernel an interpreted one: nothing to compile")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(body).parameters)
    signature = {
        p: "constexpr" if p in constexprs else pointers.get(p, "*fp32" if p.endswith("_ptr") else "i32") for p in params
    }
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(params.index(n),): v for n, v in constexprs.items()}
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
