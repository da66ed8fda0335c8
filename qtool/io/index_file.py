"""Read `model.safetensors.index.json` as (the index without its weight_map, shard -> tensor names).

A 397B index is ~41 MB of JSON with ~370k weight_map entries. Parsed whole (orjson builds a document tree
before the Python objects) it peaked at ~200 MB, and the result holds a separate shard-name string per
tensor. The weight_map is instead read entry by entry from the bytes with a strict pattern (plain JSON
strings: no escapes, no control characters), each shard name kept once; the rest of the file is parsed
as JSON with the weight_map emptied. Anything the pattern does not cover is parsed the ordinary way.
"""

from __future__ import annotations

import re
from pathlib import Path

from qtool.errors import ConfigError
from qtool.io.files import read_regular
from qtool.io.jsonio import load_json

try:
    from orjson import JSONDecodeError as _JSONError
    from orjson import loads as _loads
except ImportError:  # pragma: no cover - orjson is a declared dependency
    from json import JSONDecodeError as _JSONError  # type: ignore[assignment]
    from json import loads as _loads  # type: ignore[assignment]

_KEY = re.compile(rb'"weight_map"\s*:\s*\{\s*')
_STR = rb'"([^"\\\x00-\x1f]*)"'
_ENTRY = re.compile(_STR + rb"\s*:\s*" + _STR + rb"\s*(,\s*|\})")


def read_index(path: Path) -> tuple[dict, dict[str, list[str]] | None]:
    """(index without "weight_map", {shard: [names in file order]}). The grouping is None when the index
    has no usable weight_map (missing, not an object, empty); errors in the JSON raise ConfigError."""
    raw = read_regular(path, "safetensors index", ConfigError)
    fast = _fast(raw)
    if fast is not None:
        return fast
    del raw
    index, _ = load_json(path, what="safetensors index")
    wm = index.pop("weight_map", None)
    if not isinstance(wm, dict) or not wm:
        return index, None
    by_file: dict[str, list[str]] = {}
    for name, rel in wm.items():
        if not isinstance(rel, str):
            raise ConfigError(
                "safetensors index: a weight_map value is not a shard file name",
                path=path,
                tensor=name,
                got=f"{type(rel).__name__} {rel!r}",
                hint="each weight_map entry maps a tensor to its shard's file name (a string); "
                "restore the index from the source repository",
            )
        by_file.setdefault(rel, []).append(name)
    return index, by_file


def index_weight_map(by_file: dict[str, list[str]] | None) -> dict[str, str]:
    """The weight_map (tensor name -> shard) of `read_index`'s grouping (grouped by shard: the index's
    order of names across shards is not kept; an index is written sorted by name: writer.index_text)."""
    return {name: shard for shard, names in (by_file or {}).items() for name in names}


def _fast(raw: bytes) -> tuple[dict, dict[str, list[str]]] | None:
    m = _KEY.search(raw)
    if m is None:
        return None
    by_file: dict[str, list[str]] = {}
    shard_names: dict[bytes, str] = {}
    pos = m.end()
    match = _ENTRY.match
    # A name listed twice (JSON: the last one wins) ends up under both shards here; opening the
    # checkpoint then reports the shard that does not hold it, which is the truth about such an index.
    try:
        while True:
            e = match(raw, pos)
            if e is None:
                return None
            name = e.group(1).decode()
            rel_b = e.group(2)
            rel = shard_names.get(rel_b)
            if rel is None:
                rel = shard_names[rel_b] = rel_b.decode()
                by_file[rel] = []
            by_file[rel].append(name)
            pos = e.end()
            if e.group(3) == b"}":
                break
    except UnicodeDecodeError:
        return None
    try:
        rest = _loads(raw[: m.start()] + b'"weight_map": {}' + raw[pos:])
    except (_JSONError, UnicodeDecodeError):
        return None
    if not isinstance(rest, dict) or rest.get("weight_map") != {}:
        return None  # "weight_map" was not the top-level key
    del rest["weight_map"]
    return rest, by_file
