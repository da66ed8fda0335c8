"""What a run tells the person watching while it works (a build step starts or ends, a builtin source is
being made, an interrupted run's partial output is discarded). Library code never prints (docs/design.md): it
calls `tell`, and the CLI decides where the lines go (stderr; nowhere under --quiet)."""

from __future__ import annotations

import contextlib
import logging

from qtool.redact import redact_text

LOG = logging.getLogger("qtool")


def tell(message: str) -> None:
    LOG.info(message)


def to_stderr(enabled: bool) -> None:
    """The CLI's choice: the notices as plain lines on stderr (flushed as they come), or none."""
    for h in list(LOG.handlers):
        LOG.removeHandler(h)
    LOG.propagate = False
    if enabled:
        h = _Stderr()
        h.setFormatter(logging.Formatter("%(message)s"))
        LOG.addHandler(h)
        LOG.setLevel(logging.INFO)
    else:
        LOG.setLevel(logging.WARNING + 100)


class _Stderr(logging.Handler):
    """Whatever sys.stderr is when a line is told (not the stream of the moment the CLI started: an
    in-process caller such as pytest's capture may have replaced and closed that one since)."""

    def emit(self, record: logging.LogRecord) -> None:
        import sys

        with contextlib.suppress(OSError, ValueError):
            print(redact_text(self.format(record)), file=sys.stderr, flush=True)
