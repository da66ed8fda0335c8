"""`qtool download`: plan (resolve the commit, list files or read remote headers) then execute.

    p = plan(DownloadOptions(spec=parse_spec("hf:Qwen/Qwen3.5-397B-A17B"), out=Path("bf16"),
                             tensors=["model.layers.*.mlp.shared_expert.*"]))
    report = run(p)

Whole files go through huggingface_hub into its cache and are hard-linked (or symlinked/copied) into
`<out>`; `--tensors` writes a checkpoint of just the matching tensors, fetched by range requests
(qtool.hub.remote_safetensors). Either way the output is written through qtool.io.output (lock, --force
rules, OUT.partial/) and `<out>/qtool-manifest.json` pins the resolved commit and lists what was fetched
with its hashes (`download`) and every output file's sha256 (`files`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qtool.errors import UsageError
from qtool.hub.download import RepoListing, check_space, download_files, repo_listing
from qtool.hub.remote_safetensors import FetchPlan, TensorFetchOptions, plan_fetch
from qtool.hub.spec import HubSpec
from qtool.hub.tensor_fetch import fetch_tensors, hub_source
from qtool.io.apply import OutputJob, write_output
from qtool.io.files import LinkMode
from qtool.io.manifest import RUN
from qtool.io.output import OutputDir, check_not_in_hub_cache
from qtool.io.plan import Link, OutputPlan
from qtool.ops.contract import Report


@dataclass
class DownloadOptions:
    spec: HubSpec
    out: Path | None
    include: list[str] = field(default_factory=list)
    tensors: list[str] = field(default_factory=list)
    link: LinkMode = LinkMode.AUTO
    token: str | None = None
    force: bool = False
    resume: bool = False
    command: str | None = None  # recorded in the manifest (secrets redacted by the caller)


@dataclass
class DownloadPlan:
    options: DownloadOptions
    listing: RepoListing
    files: list[str]  # whole files (no --tensors)
    fetch: FetchPlan | None  # --tensors

    def to_json(self) -> dict:
        base = {
            "repo": self.listing.spec.repo_id,
            "revision": self.listing.spec.revision,
            "commit": self.listing.commit,
            "out": str(self.options.out) if self.options.out else None,
        }
        if self.fetch is not None:
            return {**base, "mode": "tensors", **self.fetch.to_json()}
        return {
            **base,
            "mode": "files",
            "files": {p: self.listing.files[p].to_json() for p in self.files},
            "bytes": sum(self.listing.files[p].size for p in self.files),
        }


def plan(opts: DownloadOptions) -> DownloadPlan:
    if opts.tensors and opts.out is None:
        raise UsageError("--tensors needs -o DIR", hint="the tensors are written as a new checkpoint in DIR")
    if opts.out is not None:
        check_not_in_hub_cache(opts.out)  # before any request
    listing = repo_listing(opts.spec, token=opts.token)
    if opts.tensors:
        side = listing.select(opts.include) if opts.include else None
        fp = plan_fetch(listing, TensorFetchOptions(names=opts.tensors, side_files=side), token=opts.token)
        return DownloadPlan(opts, listing, [], fp)
    files = listing.select(opts.include)
    if not files:
        raise UsageError(
            "no file matches --include",
            got=", ".join(opts.include),
            hint=f"the repo has {len(listing.files)} files; e.g. --include '*.json'",
        )
    return DownloadPlan(opts, listing, files, None)


def execute(p: DownloadPlan, *, progress: bool = False) -> Report:
    """The op contract's execute (qtool.ops.contract): fetch and write through the output transaction."""
    return Report(_run(p, progress=progress))


def _run(p: DownloadPlan, *, progress: bool = False) -> dict:
    o = p.options
    command = o.command
    if p.fetch is not None:
        assert o.out is not None
        with OutputDir(o.out, force=o.force, resume=o.resume, link=o.link) as tx:
            report = fetch_tensors(p.fetch, tx, token=o.token, progress=progress, command=command)
        return {"mode": "tensors", "out": str(o.out), **report}
    tx = OutputDir(o.out, force=o.force, resume=o.resume, link=o.link) if o.out is not None else None
    if tx is not None:
        tx.check()  # refused before any byte is downloaded
    need = check_space(p.listing, p.files, None)
    st = download_files(p.listing, p.files, token=o.token, progress=progress)
    links: dict[str, int] = {}
    report = {
        **p.to_json(),
        "files": {f.path: {"size": f.size, "digest": f.digest} for f in st.files},
        "placed": links,
    }
    # what differs between an uninterrupted run and a resumed one (or one that found files cached): the
    # manifest keeps it apart, so `download` is the same for the same commit and files (io.manifest.RUN)
    run = {
        "downloaded_bytes": need,
        "hash_failures_repaired": st.hash_failures,
        "fetched": {f.path: {"cached": f.cached, "attempts": f.attempts} for f in st.files},
    }
    if tx is not None:
        output = OutputPlan(
            "download",
            [Link(f.path, str(f.local)) for f in st.files],
            sources={"hub": hub_source(p.listing, [f.path for f in st.files])},
            inputs=[str(f.local) for f in st.files],
            summary={"repo": p.listing.spec.repo_id, "commit": p.listing.commit},
            extra={"download": report, RUN: run},
        )
        with tx:
            applied = write_output(output, tx, OutputJob(command=command))
        links.update(applied.linked)
    snap = st.files[0].local
    for _ in Path(st.files[0].path).parts:
        snap = snap.parent
    report["snapshot"] = str(snap)
    return {**report, **run}
