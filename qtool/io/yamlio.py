"""Recipe files (build recipes and quantization recipes): one strict, bounded YAML loader for both.

A recipe is a few hundred bytes of hand-written YAML; what it can hold is bounded here, before any of it
is used, so that no recipe hangs or exhausts a run and every refusal names the file and the place:
- a regular file only: a FIFO or a device named as a recipe is refused at once (qtool.io.files.open_regular
  opens it with O_NONBLOCK and looks at fstat), and at most MAX_RECIPE_BYTES are read;
- UTF-8 only: an undecodable byte is named by line, column and offset;
- no anchors or aliases: the shipped recipes use none, and an alias is how 1 KB of YAML expands to
  gigabytes (nested aliases: the "billion laughs");
- numbers of at most MAX_NUMBER_CHARS characters (Python's int() refuses 4,300 digits with a ValueError);
- booleans are `true` and `false` only (YAML 1.2): PyYAML's YAML 1.1 also reads yes / no / on / off as
  booleans, so `mtp: off` or a country code `no` would silently become False; here they stay strings, and
  the schema that expects a boolean names the key.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import ClassVar

import yaml

from qtool.io.files import open_regular

MAX_RECIPE_BYTES = 256 << 10  # the largest shipped recipe is ~1 KB
MAX_NUMBER_CHARS = 64

_NO_ALIASES = "write the values out (no anchors or aliases), as the shipped recipes do"
_NUMBERS = "give the number as a recipe means it (a count, a size), or quote it if it is text"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class _Refused(Exception):
    """Something the loader does not accept, with the position where it was found."""

    def __init__(self, message: str, mark: yaml.Mark, hint: str) -> None:
        super().__init__(message)
        self.message = f"{message} (line {mark.line + 1}, column {mark.column + 1})"
        self.hint = hint


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, less anchors and aliases, long numbers and YAML 1.1's yes/no booleans."""

    yaml_implicit_resolvers: ClassVar[dict] = {
        first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"YAML alias *{event.anchor} is not accepted in a recipe", event.start_mark, _NO_ALIASES)
        if getattr(event, "anchor", None):
            raise _Refused(f"YAML anchor &{event.anchor} is not accepted in a recipe", event.start_mark, _NO_ALIASES)
        return super().compose_node(parent, index)

    def construct_bounded_number(self, node: yaml.ScalarNode) -> int | float:
        if len(node.value) > MAX_NUMBER_CHARS:
            raise _Refused(
                f"a number of {len(node.value)} characters (at most {MAX_NUMBER_CHARS})", node.start_mark, _NUMBERS
            )
        construct = {"int": yaml.SafeLoader.construct_yaml_int, "float": yaml.SafeLoader.construct_yaml_float}
        try:
            return construct[node.tag.rsplit(":", 1)[-1]](self, node)
        except ValueError as e:  # what the number's own parse refuses
            raise _Refused(f"not a number: {e}", node.start_mark, _NUMBERS) from None


_RecipeLoader.add_implicit_resolver(_BOOL_TAG, _YAML12_BOOL, list("tTfF"))
_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _RecipeLoader.construct_bounded_number)
_RecipeLoader.add_constructor("tag:yaml.org,2002:float", _RecipeLoader.construct_bounded_number)


def load_recipe_yaml(path: str | Path, what: str, error: type) -> object:
    """The parsed YAML of a recipe file; `error` (a QtoolError type) names the file for every refusal."""
    text = _recipe_text(Path(path), what, error)
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader, stricter still
    except _Refused as e:
        raise error(f"{what}: {e.message}", path=path, hint=e.hint) from None
    except yaml.YAMLError as e:
        raise error(f"{what} is not valid YAML: {e}", path=path) from None
    except RecursionError:
        raise error(f"{what} is nested too deeply", path=path) from None


def _recipe_text(path: Path, what: str, error: type) -> str:
    if not os.path.lexists(path):
        raise error(
            f"{what} not found",
            path=path,
            hint="check the path, or pass the name of a shipped recipe (qtool recipes list)",
        )
    with os.fdopen(open_regular(path, what, error), "rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        raise error(
            f"{what} is larger than {MAX_RECIPE_BYTES >> 10} KiB",
            path=path,
            hint="a recipe is a few hundred bytes of YAML; point at the recipe, not at a data file",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise error(
            f"{what} is not UTF-8: byte 0x{data[e.start]:02x} at line {line}, column {column} (offset {e.start})",
            path=path,
            hint="save the file as UTF-8",
        ) from None
