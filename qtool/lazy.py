"""A heavy third-party module (torch) named at the top of a file but imported on first use: the codecs
read `torch.float32` like any module attribute, and a command that never runs a codec (`qtool --help`,
inspect, verify) never pays torch's import. The module is not put into `sys.modules` before its first use,
so "is torch imported?" still has its plain answer.

On first use the stand-in also puts the real module in its place in the module that made it (every global
name bound to it), so the layer loop's hot code reads `torch.x` as a plain module attribute from then on,
not through `__getattr__` (tens of thousands of reads a 397B layer)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module `name` in the module whose globals are `home`: the first attribute read imports
    it and rebinds `home`'s names for it to the module; every read is then the module's."""

    def __init__(self, name: str, home: dict[str, Any] | None = None) -> None:
        self._name = name
        self._home = home
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
            if self._home is not None:
                for key, value in list(self._home.items()):
                    if value is self:
                        self._home[key] = self._module
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str) -> Any:
    """`torch = lazy_module("torch")` at a module's top: torch is imported when an attribute is first read,
    and the module's `torch` is then torch itself."""
    return LazyModule(name, sys._getframe(1).f_globals)
