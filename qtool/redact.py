"""Secrets never leave the process: the one function every printed or written text goes through.

A Hugging Face token reaches qtool as the value of `--token` / `--hf-token`, or inside a path or URL the
user typed. `redact_text` replaces both: the values this command line gave to any spelling close to a token
flag (learned once, by `learn_from_argv`), and anything shaped like a Hub token (`hf_` and 8+ letters or
digits). The error printer, the notices, the CLI's own output streams and the manifest writer all call it;
`redact_argv` and `without_secrets` are its forms for a command line echoed or recorded.
"""

from __future__ import annotations

import difflib
import re
import shlex

SECRET_FLAGS = ("--token", "--hf-token")
_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}")
MASK = "***"
_MIN_SECRET = 4  # a shorter "value" would redact ordinary words

_secrets: set[str] = set()  # the values this process's command line gave to a token flag
_real_flags: frozenset[str] = frozenset()  # the parser's own flags: never taken for a mistyped token flag


def is_secret_flag(arg: str) -> bool:
    """Whether `arg` (a flag, `--flag=value` too) is a token flag as a user may type it: any case, `_` for
    `-`, an abbreviation (`--tok`, `--hf-tok`) or a near miss (`--tokne`), unless it is one of qtool's own
    other flags (`--to`, `--tokenizer`, `--topk`)."""
    flag = arg.split("=", 1)[0]
    if not flag.startswith("--"):
        return False
    name = flag.lower().replace("_", "-")
    if name in SECRET_FLAGS:
        return True
    if flag in _real_flags or name in _real_flags:
        return False
    if len(name) >= _MIN_SECRET and any(f.startswith(name) for f in SECRET_FLAGS):
        return True
    return bool(difflib.get_close_matches(name, SECRET_FLAGS, n=1, cutoff=0.7))


def learn_from_argv(argv: list[str], real_flags=()) -> None:
    """Remember the values given to token flags in `argv` (both forms), so that every text printed or
    written from now on hides them; `real_flags`: the parser's option strings (not secrets)."""
    global _real_flags
    _real_flags = frozenset(real_flags) - set(SECRET_FLAGS)
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        _flag, eq, value = arg.partition("=")
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if len(value) >= _MIN_SECRET:
            _secrets.add(value)


def redact_text(text: str) -> str:
    """`text` with every known token value and anything shaped like a Hub token replaced by `***`."""
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _TOKEN.sub(MASK, text)


def redact_json(value):
    """A JSON-like value (dicts, lists, strings) with every string, keys too, passed through redact_text."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact_json(k): redact_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_json(v) for v in value]
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """argv with secrets replaced by `***`: the value of a token flag (either form, any spelling
    is_secret_flag takes) and anything redact_text hides."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
        elif is_secret_flag(arg) and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=" + MASK)
        elif is_secret_flag(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_text(arg))
    return out


def command_line(argv: list[str] | None) -> str | None:
    """`argv` as one shell line with every secret redacted: what a manifest records and a message shows."""
    return None if argv is None else shlex.join(redact_argv(argv))


def without_secrets(argv: list[str]) -> tuple[list[str], bool]:
    """(argv without the token flags and their values, whether it had any): for a command line printed to
    be run again, where `--token '***'` would be a command that fails on the Hub."""
    out: list[str] = []
    dropped = skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif is_secret_flag(arg):
            dropped = True
            skip_next = "=" not in arg
        else:
            out.append(redact_text(arg))
    return out, dropped


class RedactingStream:
    """A text stream that passes what is written through redact_text (the CLI's stdout and stderr while a
    command runs: reports print paths the user typed); everything else is the wrapped stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact_text(text))
        return len(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)
