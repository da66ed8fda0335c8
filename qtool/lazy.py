"""A heavy third-party module (torch) named at the top of a file but imported on first use: the codecs
read `torch.float32` like any module attribute, and a command that never runs a codec (`qtool --help`,
inspect, verify) never pays torch's import. The module is not put into `sys.modules` before its first use,
so "is torch imported?" still has its plain answer."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for the module `name`: the first attribute read imports it, every read is then the module's."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str) -> Any:
    """`torch = lazy_module("torch")` at a module's top: torch is imported when an attribute is first read."""
    return LazyModule(name)
