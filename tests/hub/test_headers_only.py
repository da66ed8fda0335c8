"""Read-only commands on `hf:` sources read headers and configs by range requests, never the data; what
they read is cached by commit and works offline (qtool.hub.headers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qtool.cli.main import main


@pytest.fixture(scope="module")
def s397(tmp_path_factory) -> Path:
    from qtool.fixtures.sparse import build_sparse

    return build_sparse(tmp_path_factory.mktemp("s397") / "m", model="397b", flavour="modelopt-nvfp4")


def _without_path(rep: dict) -> dict:
    return {k: v for k, v in rep.items() if k != "path"}


@pytest.mark.slow
def test_inspect_of_the_397b_on_the_hub_reads_headers_only(hub, s397, capsys):
    """Found as: `qtool inspect hf:ORG/NAME` downloaded every shard (233 GB for the 397B NVFP4) although it
    reads only headers."""
    hub.add_sparse_dir("nvidia/Qwen3.5-397B-A17B-NVFP4", s397)
    assert main(["inspect", str(s397), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    before = hub.bytes_served("")
    assert main(["inspect", "hf:nvidia/Qwen3.5-397B-A17B-NVFP4", "--json"]) == 0
    out = capsys.readouterr()
    remote = json.loads(out.out)
    moved = hub.bytes_served("") - before
    assert _without_path(remote) == _without_path(local)
    assert local["total_bytes"] > 200e9  # the real size, of which ...
    assert moved < 200e6, moved  # ... under 200 MB moved
    assert "range request" in out.err and "data not downloaded" in out.err
    # again: from the cache, nothing moves (the revision is resolved once more: one API call)
    before = hub.bytes_served("/cdn/")
    assert main(["verify", "hf:nvidia/Qwen3.5-397B-A17B-NVFP4", "--json"]) in (0, 3)
    assert hub.bytes_served("/cdn/") == before
    assert json.loads(capsys.readouterr().out)["facts"]["quant_algo"]


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["modelopt-nvfp4", "ct-nvfp4"])
def test_inspect_of_the_397b_costs_few_round_trips(hub, flavour, tmp_path, capsys):
    """Found as: against a Hub that answers in 50-100 ms, header-only `inspect hf:` of the 397B made 320
    requests one after another (per shard: its length, its header, its scalars, each through a redirect),
    so latency, not bytes, set its time. Here the fake Hub waits 50 ms before every answer."""
    from qtool.fixtures.sparse import build_sparse

    src = build_sparse(tmp_path / "m", model="397b", flavour=flavour)
    shards = len(list(src.glob("*.safetensors")))
    hub.add_sparse_dir("nvidia/Qwen3.5-397B-A17B-NVFP4", src)
    hub.latency_s = 0.05
    assert main(["inspect", str(src), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    n = len(hub.log)
    assert main(["inspect", "hf:nvidia/Qwen3.5-397B-A17B-NVFP4", "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert _without_path(remote) == _without_path(local)  # the scales checks read are all there
    made = hub.log[n:]
    assert len(made) <= 200, len(made)
    # each shard: one request through the Hub (redirected), none more; the CDN location is reused
    ranged = [r for r in made if r.range is not None and "/cdn/" in r.path]
    assert len(ranged) == shards
    assert all(not r.authorized for r in made if "/cdn/" in r.path)  # the token never goes to the CDN


def test_the_cdn_location_is_reused_without_the_token_and_resolved_again_when_refused(hub, tiny_nvfp4_modelopt_nomtp):
    from qtool.hub.download import repo_listing
    from qtool.hub.remote_safetensors import RangeReader
    from qtool.hub.spec import parse_spec

    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp, private_token="hf_secret")
    listing = repo_listing(parse_spec("hf:org/nv"), token="hf_secret")
    path = sorted(p for p in listing.files if p.endswith(".safetensors"))[0]
    data = (tiny_nvfp4_modelopt_nomtp / path).read_bytes()
    reader = RangeReader(listing, token="hf_secret")
    n = len(hub.log)
    assert reader.read_bytes(path, 0, 100) == data[:100]
    assert reader.read_bytes(path, 100, 300) == data[100:300]
    first, redirected, second = hub.log[n:]
    assert "/resolve/" in first.path and first.authorized and first.status == 302
    assert "/cdn/" in redirected.path and "/cdn/" in second.path and not second.authorized
    # a CDN location that stopped working (the real one is signed and expires): asked through the Hub again
    hub.fault("expired", path)
    assert reader.read_bytes(path, 300, 400) == data[300:400]
    assert [r.path.split("/")[1] for r in hub.log[n + 3 :]] == ["cdn", "org", "cdn"]


def test_offline_uses_what_is_cached_and_names_what_is_not(hub, tiny_nvfp4_modelopt_nomtp, monkeypatch, capsys):
    commit = hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    assert main(["inspect", f"hf:org/nv@{commit}", "--json"]) == 0  # online once: cached
    online = json.loads(capsys.readouterr().out)
    assert main(["inspect", "hf:org/nv", "--json"]) == 0  # the branch resolved once: remembered
    capsys.readouterr()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.log)
    for spec in (f"hf:org/nv@{commit}", "hf:org/nv"):
        assert main(["inspect", spec, "--json"]) == 0, spec
        assert _without_path(json.loads(capsys.readouterr().out)) == _without_path(online)
        assert main(["verify", spec, "--tp", "1", "--json"]) in (0, 3)
        capsys.readouterr()
    assert len(hub.log) == n  # offline: not one request
    assert main(["inspect", "hf:org/other", "--json"]) == 1  # never seen: a named error, no traceback
    err = json.loads(capsys.readouterr().out)
    assert "not cached" in err["message"] and "hf:org/other" in err["path"] and "online" in err["hint"]


def test_a_pinned_cached_source_needs_no_network(hub, tiny_nvfp4_modelopt_nomtp, tmp_path):
    """Found as: with the network down a cached hf:ORG/NAME@COMMIT failed, because qtool asked the API
    first."""
    import os

    commit = hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    assert main(["inspect", f"hf:org/nv@{commit}", "--json"]) == 0
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing listens there: the network is down
    p = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", f"hf:org/nv@{commit}", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    p = subprocess.run(
        [sys.executable, "-m", "qtool", "inspect", "hf:org/never-seen", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "network" in json.loads(p.stdout)["message"]


def test_offline_build_dry_run_and_download(hub, tiny_nvfp4_modelopt_nomtp, tmp_path, monkeypatch, capsys):
    """Found as: HF_HUB_OFFLINE=1 gave a raw OfflineModeIsEnabled traceback in download and build
    --dry-run, also for a repo pinned at a commit that was in both caches."""
    commit = hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: r\nsources:\n  nv: {{hub: org/nv, revision: {commit}}}\n  other: {{hub: org/nv}}\n"
        "steps:\n  - {id: p, op: patch-config, input: nv, with: {fixes: [router-ignore]}}\n"
    )
    assert main(["download", "org/nv", "-o", str(tmp_path / "dl"), "--quiet"]) == 0  # online once: main resolved
    capsys.readouterr()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.log)
    assert main(["build", str(recipe), "--dry-run", "--json"]) == 0, capsys.readouterr()
    plan = json.loads(capsys.readouterr().out)
    assert plan["sources"]["nv"]["identity"]["commit"] == commit == plan["sources"]["other"]["identity"]["commit"]
    assert main(["download", "org/never-seen", "-o", str(tmp_path / "x"), "--json"]) == 1
    err = json.loads(capsys.readouterr().out)
    assert "HF_HUB_OFFLINE" in err["message"] and err["hint"]
    recipe.write_text(
        "name: r\nsources:\n  nv: {hub: org/never-seen}\nsteps:\n"
        "  - {id: p, op: patch-config, input: nv, with: {fixes: [router-ignore]}}\n"
    )
    assert main(["build", str(recipe), "--dry-run", "--json"]) == 1
    assert "never resolved" in json.loads(capsys.readouterr().out)["message"]
    assert len(hub.log) == n


def test_dry_runs_on_hub_sources_read_headers_only(hub, tiny_nvfp4_modelopt_nomtp, tiny_bf16, tmp_path, capsys):
    """The plans of calibrate-kv, quantize, assemble and patch-config --dry-run on hf: sources: configs
    and shard headers by range requests, no shard downloaded whole."""
    import hashlib

    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    hub.add_dir("org/bf16", tiny_bf16)
    blobs = {
        hashlib.sha256(p.read_bytes()).hexdigest()
        for d in (tiny_nvfp4_modelopt_nomtp, tiny_bf16)
        for p in d.glob("*.safetensors")
    }
    runs = [
        [
            "calibrate-kv",
            "hf:org/nv",
            "-o",
            str(tmp_path / "kv"),
            "--samples",
            "2",
            "--seq-len",
            "32",
            "--replace-scales",
        ],
        [
            "quantize",
            "hf:org/bf16",
            "-o",
            str(tmp_path / "q"),
            "--recipe",
            "qwen35-nvfp4-experts",
            "--samples",
            "2",
            "--seq-len",
            "32",
        ],
        ["assemble", "hybrid", "--nvfp4", "hf:org/nv", "--bf16", "hf:org/bf16", "-o", str(tmp_path / "h")],
        ["patch-config", "hf:org/nv", "--fix", "router-ignore"],
    ]
    for args in runs:
        assert main([*args, "--dry-run", "--json"]) == 0, (args, capsys.readouterr())
        capsys.readouterr()
    shard_gets = [r for r in hub.requests("GET", "/cdn/") if r.path.rsplit("/", 1)[-1] in blobs]
    assert shard_gets and all(r.range for r in shard_gets)  # ranges only: headers and small tensors
    assert not any((tmp_path / n).exists() for n in ("kv", "q", "h"))


def test_messages_name_the_hub_source_and_the_cache_is_not_a_patch_target(hub, tiny_nvfp4_modelopt_nomtp, capsys):
    """Found in review: verify's fix for an hf: source said `qtool patch-config <qtool's header cache> ...`;
    following it rewrote the cached configs, and later header-only reads reported the patched lists as
    the Hub commit's."""
    import os

    hub.add_dir("org/nv", tiny_nvfp4_modelopt_nomtp)
    assert main(["verify", "hf:org/nv", "--json"]) in (0, 3)
    text = capsys.readouterr().out
    rep = json.loads(text)
    cache = os.environ["QTOOL_CACHE_DIR"]
    assert cache not in text and rep["path"] == "hf:org/nv"
    assert any("hf:org/nv" in (f.get("fix") or "") for f in rep["findings"]), rep["findings"]
    from qtool.hub.headers import headers_dir

    stand_in = next(p for p in (Path(cache) / "hub" / "org--nv").glob("*/headers"))
    assert stand_in == headers_dir("org/nv", stand_in.parent.name)
    before = (stand_in / "config.json").read_text()
    assert main(["patch-config", str(stand_in), "--fix", "ignore-from-tensors", "--json"]) == 1
    assert "qtool's cache" in json.loads(capsys.readouterr().out)["message"]
    assert (stand_in / "config.json").read_text() == before


@pytest.mark.slow
def test_scalars_spread_through_the_shards_cost_few_requests(hub, tmp_path):
    """Found as: a header-only read of a repository written tensor by tensor in module order (a streaming
    writer's layout: every expert's scalars between its weights, not grouped by safetensors' sort) made one
    request per scalar: 21,108 requests in 120 s for the 397B, with no end in sight. The routed experts'
    scalars are left unread until a check asks for them."""
    from qtool.fixtures.sparse import build_sparse
    from qtool.hub.headers import remote_headers
    from qtool.hub.spec import HubSpec

    src = build_sparse(tmp_path / "m", model="397b", flavour="modelopt-nvfp4", module_order=True)
    shards = len(list(src.glob("*.safetensors")))
    hub.add_sparse_dir("org/streamed-397b", src)
    n, before = len(hub.log), hub.bytes_served("")
    stand_in, got = remote_headers(HubSpec("org/streamed-397b", "main"))
    made = hub.log[n:]
    assert len(made) <= 3 * shards + 20, len(made)  # ~92k before
    assert hub.bytes_served("") - before < 200e6
    assert got["deferred_ranges"] > 50_000
    # what was fetched is the source's bytes: the KV scales (outside the experts) are all there
    from qtool.io.reader import read_floats
    from qtool.io.safetensors_header import read_header

    for shard in sorted(src.glob("*.safetensors"))[:3]:
        local, remote = read_header(shard), read_header(stand_in / shard.name)
        for name, info in local.tensors.items():
            if name.endswith(("k_scale", "v_scale")):
                assert read_floats(remote.tensors[name]) == read_floats(info), name


def test_deferred_scalars_are_fetched_when_a_check_reads_them(hub, tiny_nvfp4_modelopt_nomtp, monkeypatch, capsys):
    """inspect's gate/up scale check reads every expert's global scales: on a stand-in whose experts'
    scalars were deferred it fetches those (and only those) first, and finds what a local inspect finds."""
    import shutil

    from qtool.hub import headers

    src = Path(str(tiny_nvfp4_modelopt_nomtp) + "-mismatch")
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(tiny_nvfp4_modelopt_nomtp, src)
    _set_scalar(src, "model.language_model.layers.1.mlp.experts.2.up_proj.weight_scale_2", 0.125)
    monkeypatch.setattr(headers, "EAGER_RUNS", 0)  # defer the tiny fixture's expert scalars too
    monkeypatch.setattr(headers, "HEAD_GUESS", 8)  # (its first request would take the whole tiny shard)
    assert main(["inspect", str(src), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    hub.add_dir("org/nv", src)
    assert main(["inspect", "hf:org/nv", "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert _without_path(remote) == _without_path(local)
    assert "scale-mismatch" in json.dumps(local)  # the edited expert's scale is found remotely too
    stand_in = next((Path(headers._repo_cache("org/nv"))).glob("*/headers"))
    left = json.loads((stand_in / headers.DEFERRED).read_text()) if (stand_in / headers.DEFERRED).exists() else {}
    assert sum(map(len, left.values())) < json.loads((stand_in / headers.STATS).read_text())["deferred_ranges"]


def _set_scalar(root: Path, name: str, value: float) -> None:
    import os
    import struct

    from qtool.io.checkpoint import Checkpoint

    ckpt = Checkpoint.open(root)
    info = ckpt.headers[ckpt.shard_of(name)].tensors[name]
    fd = os.open(info.file, os.O_WRONLY)
    try:
        os.pwrite(fd, struct.pack("<f", value), info.start)
    finally:
        os.close(fd)
