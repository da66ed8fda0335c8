"""`hf:ORG/NAME[@REV]` sources: the hook every command uses to turn a checkpoint argument into a local
directory (parsing a spec and Hub error translation are qtool.hub.spec's).

    resolve_checkpoint("path/to/dir")                      -> Path("path/to/dir") (no Hub access)
    resolve_checkpoint("hf:Qwen/Qwen3.5-397B-A17B")        -> the verified snapshot in the HF cache
    resolve_checkpoint("hf:...", tensors=["a", "b"])        -> a local checkpoint holding just a, b
    fetch_tensor_subset("hf:...", names)                    -> same, for `assemble hybrid --bf16 hf:...`

Revisions are resolved to a commit once (HfApi.model_info) and everything after that is fetched at that
commit, so a branch moving during a download cannot mix files of two commits.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from qtool.cache import cache_dir
from qtool.errors import CheckpointError, PlanError
from qtool.hub.download import _pin_ref, repo_listing, snapshot
from qtool.hub.remote_safetensors import TensorFetchOptions, plan_fetch
from qtool.hub.spec import PREFIX, HubError, HubSpec, is_commit, is_hub_spec, parse_spec
from qtool.hub.tensor_fetch import fetch_tensors
from qtool.io.in_place import InPlaceDir
from qtool.io.output import OutputDir

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

    return snapshot(hs, allow_download=allow_download, token=token, progress=progress)


def subset_dir(repo_id: str, commit: str, names: Sequence[str]) -> Path:
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

    hub_cache = cache_dir() / "hub"
    if Path(os.path.realpath(spec)).is_relative_to(os.path.realpath(hub_cache)):
        raise CheckpointError(
            "this is qtool's cache of a Hub checkpoint, not a checkpoint of yours",
            path=spec,
            hint="download the repo (qtool download ORG/NAME -o DIR) and change that copy",
        )

    InPlaceDir.recover(spec)  # a checkpoint an interrupted in-place swap left parked: put back first
    return Path(spec)
