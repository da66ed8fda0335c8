"""`hf:ORG/NAME[@REV]` sources: parsing, Hub error translation, and the hook every command uses to turn
a checkpoint argument into a local directory.

    resolve_checkpoint("path/to/dir")                      -> Path("path/to/dir") (no Hub access)
    resolve_checkpoint("hf:Qwen/Qwen3.5-397B-A17B")        -> the verified snapshot in the HF cache
    resolve_checkpoint("hf:...", tensors=["a", "b"])        -> a local checkpoint holding just a, b
    fetch_tensor_subset("hf:...", names)                    -> same, for `assemble hybrid --bf16 hf:...`

Revisions are resolved to a commit once (HfApi.model_info) and everything after that is fetched at that
commit, so a branch moving during a download cannot mix files of two commits.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from qtool.errors import CheckpointError, PlanError, QtoolError, UsageError, WriteError
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


# ---- the hook for other commands ------------------------------------------------------------------


def resolve_checkpoint(
    spec: str | os.PathLike,
    *,
    tensors: Sequence[str] | None = None,
    allow_download: bool = True,
    token: str | None = None,
    progress: bool = False,
) -> Path:
    """A checkpoint argument -> a local checkpoint directory.

    Local paths are returned unchanged (not even checked: Checkpoint.open reports those errors).
    `hf:` sources are resolved to a commit and downloaded through huggingface_hub into its cache (each file
    checked against the Hub's sha256) and the snapshot directory is returned; with `tensors` only those
    tensors are range-fetched into a qtool cache directory (see fetch_tensor_subset). allow_download=False
    uses only what is cached and raises HubError when something is missing."""
    if not is_hub_spec(spec):
        return Path(spec)
    hs = parse_spec(str(spec))
    if tensors is not None:
        return fetch_tensor_subset(hs, tensors, allow_download=allow_download, token=token, progress=progress)
    from qtool.hub.download import snapshot

    return snapshot(hs, allow_download=allow_download, token=token, progress=progress)


def subset_dir(repo_id: str, commit: str, names: Sequence[str]) -> Path:
    from qtool.cache import cache_dir

    key = hashlib.sha256("\n".join(sorted(set(names))).encode()).hexdigest()[:16]
    return cache_dir() / "hub" / repo_id.replace("/", "--") / commit / f"tensors-{key}"


def fetch_tensor_subset(
    spec: HubSpec | str,
    names: Sequence[str],
    *,
    allow_download: bool = True,
    token: str | None = None,
    progress: bool = False,
) -> Path:
    """A local checkpoint (index + shards + config files) holding exactly the tensors `names` of the Hub
    repo, fetched by HTTP range requests; cached under $QTOOL_CACHE_DIR/hub/<org>--<name>/<commit>/.
    Every name must exist remotely (PlanError lists the missing ones)."""
    from qtool.hub.download import repo_listing
    from qtool.hub.remote_safetensors import TensorFetchOptions, plan_fetch
    from qtool.hub.tensor_fetch import fetch_tensors
    from qtool.io.output import OutputDir

    hs = spec if isinstance(spec, HubSpec) else parse_spec(spec)
    names = sorted(set(names))
    if not names:
        raise PlanError("no tensors requested", path=str(hs))
    if not allow_download:
        found = _cached_subset(hs, names)
        if found is None:
            raise HubError(
                "tensor subset is not cached and downloads are disabled",
                path=str(hs),
                hint="run once with network access (or `qtool download --tensors ...`)",
            )
        return found
    from qtool.hub.download import _pin_ref

    listing = repo_listing(hs, token=token)
    _pin_ref(hs, listing.commit, None)
    out = subset_dir(hs.repo_id, listing.commit, names)
    if (out / "model.safetensors.index.json").exists():
        return out
    plan = plan_fetch(listing, TensorFetchOptions(names=names, exact=True), token=token)
    with OutputDir(out, resume=True) as tx:
        fetch_tensors(plan, tx, token=token, progress=progress)
    return out


def fetch_tensor_patterns(
    spec: HubSpec | str, patterns: Sequence[str], *, token: str | None = None, progress: bool = False
) -> Path:
    """Like fetch_tensor_subset, with glob / `re:` patterns instead of exact names (what `assemble hybrid
    --bf16 hf:...` needs: the shared experts, chosen layers' experts and the MTP head of an 800 GB repo)."""
    from qtool.hub.download import repo_listing
    from qtool.hub.remote_safetensors import TensorFetchOptions, plan_fetch
    from qtool.hub.tensor_fetch import fetch_tensors
    from qtool.io.output import OutputDir

    hs = spec if isinstance(spec, HubSpec) else parse_spec(spec)
    listing = repo_listing(hs, token=token)
    out = subset_dir(hs.repo_id, listing.commit, list(patterns))
    if not (out / "model.safetensors.index.json").exists():
        plan = plan_fetch(listing, TensorFetchOptions(names=list(patterns)), token=token)
        with OutputDir(out, resume=True) as tx:
            fetch_tensors(plan, tx, token=token, progress=progress)
    return out


def _cached_subset(hs: HubSpec, names: Sequence[str]) -> Path | None:
    if is_commit(hs.revision):
        commits = [hs.rev]
    else:
        from huggingface_hub import constants

        ref = Path(constants.HF_HUB_CACHE) / f"models--{hs.repo_id.replace('/', '--')}" / "refs" / hs.rev
        try:
            commits = [ref.read_text().strip()]
        except OSError:
            return None
    for c in commits:
        d = subset_dir(hs.repo_id, c, names)
        if (d / "model.safetensors.index.json").exists():
            return d
    return None


def require_local(spec: str | os.PathLike) -> Path:
    """For commands that cannot take a Hub source: a clear error instead of 'not found: hf:...'."""
    if is_hub_spec(spec):
        raise CheckpointError(
            "this argument must be a local directory",
            got=str(spec),
            hint=f"download it first: qtool download {str(spec)[len(PREFIX) :]} -o DIR",
        )
    from qtool.cache import cache_dir

    hub_cache = cache_dir() / "hub"
    if Path(os.path.realpath(spec)).is_relative_to(os.path.realpath(hub_cache)):
        raise CheckpointError(
            "this is qtool's cache of a Hub checkpoint, not a checkpoint of yours",
            path=spec,
            hint="download the repo (qtool download ORG/NAME -o DIR) and change that copy",
        )
    from qtool.io.in_place import InPlaceDir

    InPlaceDir.recover(spec)  # a checkpoint an interrupted in-place swap left parked: put back first
    return Path(spec)
