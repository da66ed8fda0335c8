"""config.json / hf_quant_config.json / generation_config.json IO.

Keeps key order (Python dicts do) and the file's own indentation and trailing newline, writes atomically
(temp file in the same directory, fsync, rename) and shows unified diffs, so that a patched config differs
from the original only in the keys that were changed.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import ConfigError, WriteError
from qtool.io.files import read_regular

try:  # a 397B index has ~370k weight_map entries; orjson parses it several times faster
    from orjson import dumps as _odumps
    from orjson import loads as _loads

    def dumps_compact(obj: object) -> str:
        """One line, no spaces, UTF-8 as is (the same text as the fallback's)."""
        return _odumps(obj).decode()
except ImportError:  # orjson is a declared dependency; an environment without it still works, slower
    _loads = json.loads  # type: ignore[assignment]

    def dumps_compact(obj: object) -> str:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


loads = _loads  # bytes or str -> object, the fast parser where there is one


@dataclass
class JsonStyle:
    indent: int | str | None = 2
    trailing_newline: bool = True
    ensure_ascii: bool = False


def detect_style(text: str) -> JsonStyle:
    m = re.search(r"\n([ \t]+)\S", text)
    if m is None:
        indent: int | str | None = None if "\n" not in text.strip() else 0
    else:
        ws = m.group(1)
        indent = ws if "\t" in ws else len(ws)
    return JsonStyle(indent=indent, trailing_newline=text.endswith("\n"), ensure_ascii="\\u" in text)


def load_json(path: str | Path, *, what: str = "JSON file") -> tuple[dict, JsonStyle]:
    """Load a JSON object; ConfigError names the file and the position of a syntax error."""
    path = Path(path)
    text = _read_text(path, what)
    try:
        obj = _loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            path=path,
            hint="fix the JSON syntax (or restore the file from the source repository)",
        ) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{what} must hold a JSON object", path=path, got=type(obj).__name__)
    return obj, detect_style(text)


def file_style(path: str | Path, *, what: str = "JSON file") -> JsonStyle:
    """The style of a JSON file, without parsing it (a 397B index is 41 MB: parsed only for its style it
    took 0.46 s on the 2-core VM); the file's own parse, where it matters, already checked it."""
    return detect_style(_read_text(Path(path), what))


def _read_text(path: Path, what: str) -> str:
    """A JSON file's text; ConfigError names the file (missing, not a regular file, not UTF-8)."""
    try:
        return read_regular(path, what, ConfigError).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 ({e})", path=path) from None


def dumps(obj: dict, style: JsonStyle | None = None) -> str:
    style = style or JsonStyle()
    text = json.dumps(obj, indent=style.indent, ensure_ascii=style.ensure_ascii)
    return text + ("\n" if style.trailing_newline else "")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` so that readers see either the old or the new file, never a partial one."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a name with non-UTF-8 bytes in the text: the commands refuse those up front
        raise WriteError(
            "the text to write holds a name that is not UTF-8 (a file or directory name with other bytes)",
            path=path,
            hint="rename the input or output to a UTF-8 name",
        ) from None
    atomic_write_bytes(path, data)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see either the old or the new file, never a partial one
    (written to a temporary file beside it, fsynced, renamed)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".qtool-tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if path.exists():
                os.chmod(tmp, path.stat().st_mode & 0o777)
            else:
                os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    except OSError as e:
        raise WriteError(f"cannot write file ({e.strerror})", path=path) from None


def write_json(path: str | Path, obj: dict, style: JsonStyle | None = None) -> None:
    atomic_write_text(path, dumps(obj, style))


def unified_diff(old: str, new: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{name}", f"b/{name}")
    )
