"""Checkpoint arguments: a local path, or an `hf:ORG/NAME[@REV]` source that qtool.hub downloads or
reads header-only, turned into the local directory a command reads. The stand-ins it makes are recorded
in qtool.cli.common.STAND_INS, so that messages name the user's source, not qtool's cache."""

from __future__ import annotations

import sys

from qtool.cli.common import STAND_INS
from qtool.hub.headers import remote_headers
from qtool.hub.resolve import require_local, resolve_checkpoint
from qtool.hub.spec import is_hub_spec, parse_spec
from qtool.sizes import human_bytes


def local_checkpoint(spec, *, tensors=None, progress: bool | None = None):
    """A checkpoint argument (local path or `hf:ORG/NAME[@REV]`) -> a local directory; Hub sources are
    downloaded (verified) through qtool.hub, with progress bars when stderr is a terminal (progress=None).
    huggingface_hub is imported by qtool.hub where a download needs it, not for --help."""
    return resolve_checkpoint(spec, tensors=tensors, progress=sys.stderr.isatty() if progress is None else progress)


def headers_checkpoint(spec, *, token=None):
    """For commands that read only headers and configs (inspect, verify without --deep, serve-config): a
    local path as it is; `hf:ORG/NAME[@REV]` as a header-only stand-in (qtool.hub.headers: configs and
    shard headers by range requests, cached by commit, offline when cached), its traffic on stderr."""
    if not is_hub_spec(spec):
        return local_checkpoint(spec)
    path, got = remote_headers(parse_spec(str(spec)), token=token)
    STAND_INS[str(path)] = str(spec)
    how = (
        "from the cache, nothing fetched"
        if got["cached"]
        else (f"{human_bytes(got['bytes_moved'])} in {got['requests']} range request(s)")
    )
    print(f"{spec}: headers and configs of commit {got['commit'][:12]} ({how}); data not downloaded", file=sys.stderr)
    return path


def local_only(spec):
    """For commands that write into the checkpoint itself: a Hub source gets a clear error."""
    return require_local(spec)
