"""`qtool download` and qtool.hub against the local fake Hub (tests/fake_hub.py), with fault injection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_hub import make_repo_dir, read_tensor_bytes

from qtool.cli.main import main
from qtool.errors import PlanError, UsageError, VerificationError, WriteError
from qtool.hub.resolve import resolve_checkpoint
from qtool.hub.spec import HubError, parse_spec

SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"
SHARED = "*.mlp.shared_expert*"


def _out_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_parse_spec():
    assert parse_spec("hf:Qwen/Qwen3.5-397B-A17B@main").repo_id == "Qwen/Qwen3.5-397B-A17B"
    assert parse_spec("hf:a/b").revision is None
    assert parse_spec("a/b@v1", require_prefix=False).revision == "v1"
    for bad in ("hf:nope", "hf:a/b@", "hf:/b", "a/b"):
        with pytest.raises(UsageError):
            parse_spec(bad)
    assert resolve_checkpoint("some/local/dir") == Path("some/local/dir")


def test_full_download_pins_commit_and_matches(hub, repo_dir, tmp_path, capsys):
    commit = hub.add_dir("org/model", repo_dir)
    out = tmp_path / "out"
    assert main(["download", "org/model", "-o", str(out), "--json"]) == 0
    rep = _out_json(capsys)
    assert rep["commit"] == commit
    for p in repo_dir.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    pinned = json.loads((out / "qtool-manifest.json").read_text())["download"]
    assert (
        pinned["commit"] == commit
        and pinned["files"][SHARD1]["digest"] == hub.repos["org/model"].commits[commit][SHARD1].sha256
    )
    # every file was resolved at the pinned commit, never at the branch name
    resolves = [r.path for r in hub.requests(contains="/resolve/")]
    assert resolves and all(f"/resolve/{commit}/" in p for p in resolves)


def test_include_and_revision(hub, repo_dir, tmp_path, capsys):
    old = hub.add_dir("org/model", repo_dir, branch="v1")
    (repo_dir / "config.json").write_text('{"changed": true}')
    new = hub.add_dir("org/model", repo_dir)
    assert old != new
    out = tmp_path / "cfg"
    assert main(["download", "org/model@v1", "-o", str(out), "--include", "*.json", "--json"]) == 0
    rep = _out_json(capsys)
    assert rep["commit"] == old
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors.index.json",
        "qtool-manifest.json",
        "tokenizer_config.json",
    ]
    assert "changed" not in (out / "config.json").read_text()


def test_dropped_connection_is_resumed(hub, repo_dir, tmp_path):
    hub.add_dir("org/model", repo_dir)
    hub.fault("drop", SHARD2)
    assert main(["download", "org/model", "-o", str(tmp_path / "o"), "--include", SHARD2, "--quiet"]) == 0
    assert (tmp_path / "o" / SHARD2).read_bytes() == (repo_dir / SHARD2).read_bytes()
    gets = [r for r in hub.requests("GET", "/cdn/")]
    assert len(gets) == 2 and gets[0].body_bytes < (repo_dir / SHARD2).stat().st_size


def test_corrupted_bytes_are_caught_and_refetched(hub, repo_dir, tmp_path, capsys):
    hub.add_dir("org/model", repo_dir)
    hub.fault("corrupt", SHARD1)
    assert main(["download", "org/model", "-o", str(tmp_path / "o"), "--include", SHARD1, "--json"]) == 0
    rep = _out_json(capsys)
    assert len(rep["hash_failures_repaired"]) == 1 and "sha256" in rep["hash_failures_repaired"][0]
    assert (tmp_path / "o" / SHARD1).read_bytes() == (repo_dir / SHARD1).read_bytes()


def test_persistent_corruption_fails_verification(hub, repo_dir, tmp_path, capsys):
    hub.add_dir("org/model", repo_dir)
    hub.fault("corrupt", SHARD1, times=10)
    assert main(["download", "org/model", "-o", str(tmp_path / "o"), "--include", SHARD1, "--json"]) == 3
    err = _out_json(capsys)
    assert err["error"] == "VerificationError" and err["path"] == SHARD1
    assert not (tmp_path / "o").exists()
    # the bad blob is not left in the HF cache
    blobs = list((tmp_path / "hf-cache").rglob("blobs/*"))
    assert not [b for b in blobs if b.stat().st_size == (repo_dir / SHARD1).stat().st_size]


def test_corrupted_small_file_caught_by_git_blob_id(hub, repo_dir, tmp_path, capsys):
    hub.add_dir("org/model", repo_dir)
    hub.fault("corrupt", "config.json", times=10)
    with pytest.raises(VerificationError, match="hash"):
        from qtool.hub.download import download_files, repo_listing

        download_files(repo_listing(parse_spec("hf:org/model")), ["config.json"])


@pytest.mark.parametrize(
    "setup,args,needle",
    [
        ("none", ["download", "org/missing", "-o", "X"], "repository not found"),
        ("private", ["download", "org/model", "-o", "X"], "repository not found, or private"),
        ("gated", ["download", "org/model", "-o", "X"], "gated"),
        ("plain", ["download", "org/model@nope", "-o", "X"], "revision not found"),
        ("404", ["download", "org/model", "-o", "X", "--include", "config.json"], "file not found"),
    ],
)
def test_hub_errors_are_explained(hub, repo_dir, tmp_path, capsys, setup, args, needle):
    if setup == "private":
        hub.add_dir("org/model", repo_dir, private_token="hf_secret")
    elif setup == "gated":
        hub.add_dir("org/model", repo_dir, gated=True)
    elif setup in ("plain", "404"):
        hub.add_dir("org/model", repo_dir)
        hub.fault("404", "config.json")
    args = [str(tmp_path / "o") if a == "X" else a for a in args]
    assert main(args + ["--json"]) == 1
    err = _out_json(capsys)
    assert needle in err["message"], err
    assert err["hint"]
    if setup in ("private", "gated"):
        assert "HF_TOKEN" in err["hint"]


def test_private_repo_with_token(hub, repo_dir, tmp_path):
    hub.add_dir("org/model", repo_dir, private_token="hf_secret")
    assert (
        main(
            [
                "download",
                "org/model",
                "-o",
                str(tmp_path / "o"),
                "--include",
                "*.json",
                "--token",
                "hf_secret",
                "--quiet",
            ]
        )
        == 0
    )
    assert (tmp_path / "o" / "config.json").exists()


def test_no_space(hub, repo_dir):
    from qtool.hub.download import check_space, repo_listing

    hub.add_dir("org/model", repo_dir)
    listing = repo_listing(parse_spec("hf:org/model"))
    with pytest.raises(WriteError, match="free space"):
        check_space(listing, list(listing.files), None, free=lambda p: 1000)
    assert check_space(listing, list(listing.files), None, free=lambda p: 10**12) > 0


# ---- --tensors ---------------------------------------------------------------------------------------


def _shared_names(root: Path) -> list[str]:
    from qtool.io.checkpoint import Checkpoint

    return sorted(n for n in Checkpoint.open(root).tensors if ".mlp.shared_expert" in n)


def test_tensors_fetch_only_ranges(hub, repo_dir, tmp_path, capsys):
    hub.add_dir("org/model", repo_dir)
    out = tmp_path / "se"
    assert main(["download", "org/model", "-o", str(out), "--tensors", SHARED, "--json"]) == 0
    rep = _out_json(capsys)
    names = _shared_names(repo_dir)
    from qtool.io.checkpoint import Checkpoint

    ck = Checkpoint.open(out)
    assert sorted(ck.tensors) == names and len(names) == 16
    for n in names:
        assert read_tensor_bytes(out, n) == read_tensor_bytes(repo_dir, n)
    want = sum(ck.tensors[n].nbytes for n in names)
    assert rep["bytes"] == want
    # data served = the tensors' bytes + one head read a shard (its length and header, and the small tensors
    # after it, in one bounded range: 8 + 64 KiB here); less than the repo's weights even at this toy size
    weights = sum(p.stat().st_size for p in repo_dir.glob("*.safetensors"))
    gets = hub.requests("GET", "/cdn/")
    heads = [r for r in gets if r.range and r.range.startswith("bytes=0-")]
    assert len(heads) == 3 and all(r.body_bytes <= 8 + (64 << 10) for r in heads)
    assert sum(r.body_bytes for r in gets if r not in heads) == want
    assert hub.bytes_served("/cdn/") == want + sum(r.body_bytes for r in heads) < weights
    # adjacent tensors coalesced: one request per (shard, layer) - a layer's shared-expert tensors are adjacent
    src = Checkpoint.open(repo_dir)
    groups = {(src.shard_of(n), n.split(".")[3]) for n in names}
    assert rep["range_requests"] == len(groups) < len(names)
    assert (out / "config.json").exists() and json.loads((out / "qtool-manifest.json").read_text())["download"][
        "commit"
    ]


def test_tensors_regex_and_no_match(hub, repo_dir, tmp_path, capsys):
    hub.add_dir("org/model", repo_dir)
    assert (
        main(
            [
                "download",
                "org/model",
                "-o",
                str(tmp_path / "a"),
                "--tensors",
                r"re:layers\.0\.mlp\.gate\.weight$",
                "--dry-run",
                "--json",
            ]
        )
        == 0
    )
    assert _out_json(capsys)["tensors"] == 1
    assert not (tmp_path / "a").exists()
    assert main(["download", "org/model", "-o", str(tmp_path / "b"), "--tensors", "nothing.*", "--json"]) == 1
    assert "no tensor matches" in _out_json(capsys)["message"]


@pytest.mark.parametrize("index", ['{"weight_map": {"a": ', '{"metadata": {}}'])
def test_tensors_with_a_malformed_remote_index(hub, repo_dir, tmp_path, capsys, index):
    (repo_dir / "model.safetensors.index.json").write_text(index)
    hub.add_dir("org/model", repo_dir)
    assert main(["download", "org/model", "-o", str(tmp_path / "a"), "--tensors", SHARED, "--json"]) != 0
    err = _out_json(capsys)
    assert "remote index is malformed" in err["message"] and "model.safetensors.index.json" in err["path"]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("fault", ["drop", "ignore_range"])
def test_tensors_survive_faults(hub, repo_dir, tmp_path, capsys, fault):
    hub.add_dir("org/model", repo_dir)
    # ignore_range also hits the two header reads of shard 1; drop skips them and hits the data ranges
    hub.fault(fault, SHARD1, times=4, skip=2 if fault == "drop" else 0)
    out = tmp_path / "se"
    assert main(["download", "org/model", "-o", str(out), "--tensors", SHARED, "--json"]) == 0
    rep = _out_json(capsys)
    for n in _shared_names(repo_dir):
        assert read_tensor_bytes(out, n) == read_tensor_bytes(repo_dir, n)
    if fault == "drop":
        assert rep["fetch"]["retries"] >= 1
    else:
        assert rep["fetch"]["ranges_ignored"] >= 1 and rep["fetch"]["bytes_discarded"] > 0


@pytest.mark.parametrize("what", [[], ["--tensors", SHARED]])
def test_a_disk_too_small_for_the_output_leaves_no_partial(hub, repo_dir, tmp_path, capsys, monkeypatch, what):
    """The output's free-space refusal (qtool.io.apply) left an empty OUT.partial/ behind."""
    import qtool.io.apply as apply

    hub.add_dir("org/model", repo_dir)
    out = tmp_path / "o"
    monkeypatch.setattr(apply, "free_space", lambda p: 1000)
    assert main(["download", "org/model", "-o", str(out), *what, "--json"]) == 1
    err = _out_json(capsys)
    assert "not enough free disk space" in err["message"] and err["path"] == str(out) and "-o" in err["hint"]
    assert not out.exists() and not (tmp_path / "o.partial").exists()


def test_tensors_resume_after_interruption(hub, repo_dir, tmp_path, capsys, monkeypatch):
    from qtool.hub import remote_safetensors as rs

    hub.add_dir("org/model", repo_dir)
    out = tmp_path / "se"
    monkeypatch.setattr(rs, "MAX_RETRIES", 0)
    hub.fault("drop", SHARD2, skip=2)  # the two header reads pass; the first data range drops halfway
    assert main(["download", "org/model", "-o", str(out), "--tensors", SHARED, "--json"]) == 1
    assert "network error" in _out_json(capsys)["message"]
    partial = tmp_path / "se.partial"
    assert (partial / SHARD1).exists() and (partial / (SHARD2 + ".part")).exists() and not out.exists()
    monkeypatch.setattr(rs, "MAX_RETRIES", 5)
    before, seen = hub.bytes_served("/cdn/"), len(hub.requests("GET", "/cdn/"))
    assert main(["download", "org/model", "-o", str(out), "--tensors", SHARED, "--resume", "--json"]) == 0
    rep = _out_json(capsys)
    for n in _shared_names(repo_dir):
        assert read_tensor_bytes(out, n) == read_tensor_bytes(repo_dir, n)
    assert rep["resumed_bytes"] > 0
    # the resumed run re-reads the remote headers: one bounded head read a shard
    headers = sum(r.body_bytes for r in hub.requests("GET", "/cdn/")[seen:] if r.range.startswith("bytes=0-"))
    assert headers <= 3 * (8 + (64 << 10))
    assert hub.bytes_served("/cdn/") - before <= rep["bytes"] - rep["resumed_bytes"] + headers
    # the manifest equals an uninterrupted run's but for its `run` section (resume counters, requests)
    ref = tmp_path / "ref"
    assert main(["download", "org/model", "-o", str(ref), "--tensors", SHARED, "--json"]) == 0
    capsys.readouterr()

    def but_run(d):
        m = json.loads((d / "qtool-manifest.json").read_text())
        assert m.pop("run")["resumed_bytes"] == (rep["resumed_bytes"] if d == out else 0)
        m.pop("command")
        return m

    assert but_run(out) == but_run(ref)


def test_tensors_resume_after_the_branch_moved_is_refused(hub, repo_dir, tmp_path, capsys, monkeypatch):
    """Found as: `download --tensors --resume` after the branch moved continued the old commit's partial
    shards with the new commit's bytes (same headers, other data)."""
    from qtool.hub import remote_safetensors as rs

    old = hub.add_dir("org/model", repo_dir)
    out = tmp_path / "se"
    monkeypatch.setattr(rs, "MAX_RETRIES", 0)
    hub.fault("drop", SHARD2, skip=2)
    args = ["download", "org/model", "-o", str(out), "--tensors", SHARED, "--json"]
    assert main(args) == 1
    capsys.readouterr()
    new = hub.add_dir("org/model", make_repo_dir(tmp_path / "src2", seed=1))  # same names, other bytes
    assert new != old
    monkeypatch.setattr(rs, "MAX_RETRIES", 5)
    assert main([*args, "--resume"]) == 1
    err = _out_json(capsys)
    assert "another commit" in err["message"] and old in json.dumps(err)
    assert not out.exists()
    assert main(["download", f"org/model@{old}", *args[2:], "--resume"]) == 0
    capsys.readouterr()
    for n in _shared_names(repo_dir):
        assert read_tensor_bytes(out, n) == read_tensor_bytes(repo_dir, n)
    assert json.loads((out / "qtool-manifest.json").read_text())["sources"]["hub"]["commit"] == old


def test_tensor_subset_for_assemble(hub, repo_dir, tmp_path):
    from qtool.hub.resolve import fetch_tensor_subset

    hub.add_dir("org/model", repo_dir)
    names = _shared_names(repo_dir)[:3]
    d = resolve_checkpoint("hf:org/model", tensors=names)
    from qtool.io.checkpoint import Checkpoint

    assert sorted(Checkpoint.open(d).tensors) == names
    n_req = len(hub.log)
    assert fetch_tensor_subset("hf:org/model", names) == d  # cached: only the commit lookup
    assert len(hub.log) - n_req == 1
    assert resolve_checkpoint("hf:org/model", tensors=names, allow_download=False) == d
    with pytest.raises(PlanError, match="not in the repository"):
        fetch_tensor_subset("hf:org/model", names + ["model.no.such.tensor"])


def test_full_snapshot_resolution_and_offline(hub, repo_dir):
    hub.add_dir("org/model", repo_dir)
    d = resolve_checkpoint("hf:org/model")
    assert (d / "config.json").read_text() == (repo_dir / "config.json").read_text()
    from qtool.io.checkpoint import Checkpoint

    assert len(Checkpoint.open(d).tensors) == 33
    assert resolve_checkpoint("hf:org/model", allow_download=False) == d
    with pytest.raises(HubError):
        resolve_checkpoint("hf:org/other", allow_download=False)


def test_tree_and_paths_info_endpoints(hub, repo_dir):
    """The emulated listing endpoints answer what huggingface_hub parses (pagination included)."""
    from huggingface_hub import HfApi

    commit = hub.add_dir("org/model", repo_dir)
    api = HfApi()
    tree = list(api.list_repo_tree("org/model", recursive=True))
    assert len(tree) == 7 and hub.page_size == 3  # three pages
    lfs = {f.path: f.lfs.sha256 for f in tree if f.lfs}
    assert lfs[SHARD1] == hub.repos["org/model"].commits[commit][SHARD1].sha256
    info = api.get_paths_info("org/model", ["config.json", SHARD2], revision=commit)
    assert sorted(i.path for i in info) == ["config.json", SHARD2]
    meta = api.get_safetensors_metadata("org/model")
    assert len(meta.weight_map) == 33


def test_snapshot_download_against_fake(hub, repo_dir, tmp_path):
    """snapshot_download itself (model_info/tree + HEAD/GET per file) works against the emulation."""
    from huggingface_hub import snapshot_download

    hub.add_dir("org/model", make_repo_dir(tmp_path / "r2", layers=1, shards=1))
    d = Path(snapshot_download("org/model"))
    assert (d / "model-00001-of-00001.safetensors").exists()
