"""`hf:ORG/NAME[@REV]` sources as data, and what every Hub-facing module shares: parsing a spec, the
translation of huggingface_hub's errors into qtool's (`hub_errors`), offline mode, and the commit a branch
was last resolved to. Below resolve, download, remote_safetensors and tensor_fetch, which all use it.

    parse_spec("hf:Qwen/Qwen3.5-397B-A17B@main")          -> HubSpec(repo_id, revision)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import QtoolError, UsageError, WriteError
from qtool.io.checkpoint import REPO_NAME as _REPO

PREFIX = "hf:"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubError(QtoolError):
    """The Hub refused or could not serve a request (auth, gated, missing repo/revision/file, network)."""


@dataclass(frozen=True)
class HubSpec:
    repo_id: str
    revision: str | None = None  # None: the default branch

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def __str__(self) -> str:
        return f"{PREFIX}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def is_hub_spec(spec: str | os.PathLike) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse_spec(spec: str, *, require_prefix: bool = True) -> HubSpec:
    """`hf:ORG/NAME[@REV]` (or `ORG/NAME[@REV]` when require_prefix is False) -> HubSpec."""
    text = spec
    if text.startswith(PREFIX):
        text = text[len(PREFIX) :]
    elif require_prefix:
        raise UsageError("not a Hub source", got=spec, hint="write hf:ORG/NAME or hf:ORG/NAME@REVISION")
    repo, _, rev = text.partition("@")
    if not _REPO.match(repo) or (rev == "" and "@" in text):
        raise UsageError(
            "malformed Hub repository",
            got=spec,
            hint="write hf:ORG/NAME[@REVISION], e.g. hf:Qwen/Qwen3.5-397B-A17B@main",
        )
    return HubSpec(repo, rev or None)


def is_commit(rev: str | None) -> bool:
    return bool(rev) and bool(_COMMIT.match(rev or ""))


@contextlib.contextmanager
def hub_errors(spec: HubSpec | str, path: str | None = None) -> Iterator[None]:
    """Translate huggingface_hub / httpx / OS errors into HubError with a fix.

    Exception classes: huggingface_hub/errors.py; the mapping from HTTP status + X-Error-Code to them is
    utils/_http.py hf_raise_for_status (401 without a valid token is reported as RepositoryNotFoundError)."""
    import httpx
    from huggingface_hub import errors as hfe

    where = f"{spec}" + (f" {path}" if path else "")
    token_hint = (
        "log in with `hf auth login` or set HF_TOKEN to a token that can read the repo "
        "(for gated repos, accept the conditions on the model page first)"
    )
    try:
        yield
    except hfe.GatedRepoError as e:
        raise HubError(
            "the repository is gated and this token has no access", path=where, got=_status(e), hint=token_hint
        ) from None
    except hfe.RevisionNotFoundError as e:
        raise HubError(
            "revision not found",
            path=where,
            got=_status(e),
            hint="check the branch, tag or commit after '@' (hf:ORG/NAME@REV)",
        ) from None
    except (hfe.RemoteEntryNotFoundError, hfe.EntryNotFoundError) as e:
        raise HubError(
            "file not found in the repository", path=where, got=_status(e), hint="check the file name and the revision"
        ) from None
    except hfe.RepositoryNotFoundError as e:
        raise HubError(
            "repository not found, or private and this token has no access",
            path=where,
            got=_status(e),
            hint="check ORG/NAME; " + token_hint,
        ) from None
    except hfe.OfflineModeIsEnabled:
        raise HubError(
            "HF_HUB_OFFLINE is set, and this needs the Hub (nothing usable is cached for it)",
            path=where,
            hint="unset HF_HUB_OFFLINE, or run it once online first; a revision qtool "
            "has read before is used from the cache (pin it: hf:ORG/NAME@COMMIT)",
        ) from None
    except hfe.LocalEntryNotFoundError:
        raise HubError(
            "not in the local cache and the Hub cannot be reached",
            path=where,
            hint="check the network and HF_ENDPOINT, or unset HF_HUB_OFFLINE",
        ) from None
    except hfe.HfHubHTTPError as e:
        code = _status(e)
        if code in (401, 403):
            raise HubError("access denied by the Hub", path=where, got=code, hint=token_hint) from None
        raise HubError(
            f"the Hub answered an error: {str(e).splitlines()[0]}",
            path=where,
            got=code,
            hint="retry later; if it persists check HF_ENDPOINT and the repo page",
        ) from None
    except (httpx.TransportError, httpx.TooManyRedirects) as e:
        raise HubError(
            f"network error talking to the Hub ({type(e).__name__}: {e})",
            path=where,
            hint="check the network, HF_ENDPOINT and proxies, then rerun (finished files are kept)",
        ) from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise WriteError(
                "no space left on device",
                path=getattr(e, "filename", None) or where,
                hint="free space, or point HF_HUB_CACHE / -o at a larger disk",
            ) from None
        raise


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_commit(spec: HubSpec) -> str | None:
    """The commit of `spec` without asking the Hub: a pinned commit, or a branch resolved before (qtool
    records every resolution in huggingface_hub's cache refs, as snapshot_download does)."""
    if is_commit(spec.revision):
        return spec.revision
    from huggingface_hub import constants

    ref = Path(constants.HF_HUB_CACHE) / f"models--{spec.repo_id.replace('/', '--')}" / "refs" / spec.rev
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if is_commit(commit) else None


def _status(e: Exception) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)
