"""quantize's start: the first layer's bytes are read while the output is planned (the plan is per-tensor
Python, 3 s for the 397B's 372k output tensors on the 2-core VM, that the read used to wait for), with the
input's sha256 still taken from those reads; a --resume reads the layer it goes on from; a plan that fails
after the read began leaves no thread behind; a dry run still makes the whole plan."""

from __future__ import annotations

import hashlib
import importlib
import json
import threading
import time
from pathlib import Path

import pytest

from qtool.errors import PlanError
from qtool.io.stream_digest import StreamDigests
from qtool.recipes import load_recipe
from qtool.stream.layer_read import Prefetcher

output_module = importlib.import_module("qtool.ops.quantize.output")
layer_module = importlib.import_module("qtool.ops.quantize.layer")
RECIPE = "qwen35-nvfp4-experts"


@pytest.fixture(scope="module")
def reference(tiny_bf16, calib_ids, tmp_path_factory) -> Path:
    """An uninterrupted run's output."""
    from qtool.ops.quantize import run

    out = tmp_path_factory.mktemp("start") / "ref"
    run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids)
    return out


def _events(monkeypatch) -> list:
    """('read', layer, files the input hasher takes from the reads) as each layer's read ahead begins,
    ('output plan',) as the output plan is made."""
    events: list = []
    start, plan = Prefetcher.start, output_module.output_plan

    def read(self, key, infos):
        digests = self.digests
        events.append(("read", key, len(digests.files) if isinstance(digests, StreamDigests) else 0))
        return start(self, key, infos)

    monkeypatch.setattr(Prefetcher, "start", read)
    monkeypatch.setattr(output_module, "output_plan", lambda p: events.append(("output plan",)) or plan(p))
    return events


def _same_files(a: Path, b: Path) -> None:
    names = sorted(f.name for f in a.iterdir() if f.suffix == ".safetensors")
    assert names == sorted(f.name for f in b.iterdir() if f.suffix == ".safetensors")
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def _digests_are_the_inputs(out: Path, src: Path) -> None:
    m = json.loads((out / "qtool-manifest.json").read_text())
    files = m["sources"][next(iter(m["sources"]))]["files"]
    shards = sorted(src.glob("*.safetensors"))
    assert shards
    for f in shards:
        assert files[f.name]["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest(), f.name


def test_the_first_layer_is_read_while_the_output_is_planned(tiny_bf16, calib_ids, reference, tmp_path, monkeypatch):
    from qtool.ops.quantize import run

    monkeypatch.setenv("QTOOL_CACHE_DIR", str(tmp_path / "cache"))  # no digest on record: hashed from the reads
    events = _events(monkeypatch)
    out = tmp_path / "q"
    rep = run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids)
    from qtool.io.checkpoint import Checkpoint
    from qtool.stream.layer_stream import streamed_files

    shards = len(streamed_files(Checkpoint.open(tiny_bf16)))
    assert shards > 0
    # the input's hashes taken from the reads from the first one on (a read before the hasher: its bytes
    # read again by the hash); not read again when the layers begin
    assert events[:2] == [("read", 0, shards), ("output plan",)]
    assert [e for e in events if e[:2] == ("read", 0)] == [events[0]]
    assert rep["output"]["problems"] == [] and rep["plan"]["output_shards"] == rep["output"]["shards"]
    _same_files(out, reference)
    _digests_are_the_inputs(out, tiny_bf16)  # the reads begun before the plan were hashed


def test_a_resume_reads_the_layer_it_goes_on_from_first(tiny_bf16, calib_ids, reference, tmp_path, monkeypatch):
    from qtool.ops.quantize import run

    out = tmp_path / "r"
    real = layer_module.write_layer_shard

    def stop_at_layer_2(path, lp, *a, **k):
        if lp.index == 2:
            raise KeyboardInterrupt  # Ctrl-C during layer 2: layers 0-1 are journaled
        return real(path, lp, *a, **k)

    monkeypatch.setattr(layer_module, "write_layer_shard", stop_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids)
    monkeypatch.setattr(layer_module, "write_layer_shard", real)
    partial = tmp_path / "r.partial"
    kept = sorted(f.name for f in partial.glob("*.safetensors"))
    assert "model-layer-00001.safetensors" in kept

    def fails(p):
        raise PlanError("an output plan that fails", path=p.out)

    monkeypatch.setattr(output_module, "output_plan", fails)
    with pytest.raises(PlanError, match="an output plan that fails"):  # a --resume refused by its plan
        run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids, resume=True)
    assert sorted(f.name for f in partial.glob("*.safetensors")) == kept  # keeps the interrupted run's work
    monkeypatch.undo()
    events = _events(monkeypatch)
    rep = run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids, resume=True)
    assert rep["resumed_from_layer"] == 2
    assert [e[:2] for e in events[:2]] == [("read", 2), ("output plan",)]
    assert len([e for e in events if e[:2] == ("read", 2)]) == 1
    _same_files(out, reference)


def test_a_plan_that_fails_after_the_read_began_leaves_nothing_running(
    tiny_bf16, calib_ids, reference, tmp_path, monkeypatch
):
    from qtool.ops.quantize import run
    from qtool.stream import layer_read

    before = set(threading.enumerate())
    reading = threading.Event()
    slow_read = layer_read.ShardFiles.read

    def slow(*args, **kwargs):  # the read still running when the plan fails
        reading.set()
        time.sleep(0.05)
        return slow_read(*args, **kwargs)

    def fails(p):
        assert reading.wait(10)
        raise PlanError("an output plan that fails", path=p.out)

    monkeypatch.setattr(layer_read.ShardFiles, "read", slow)
    monkeypatch.setattr(output_module, "output_plan", fails)
    out = tmp_path / "q"
    with pytest.raises(PlanError, match="an output plan that fails"):
        run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids)
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not [n for n in left if n.startswith(("qtool-layer-read", "qtool-stream-sha256", "qtool-sha256"))], left
    # refused by its plan: nothing of the run is left, as of a refusal before the output is opened
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    run(tiny_bf16, out=out, recipe=load_recipe(RECIPE), calib_ids=calib_ids)  # and the next run is not in its way
    _same_files(out, reference)


def test_a_dry_run_makes_the_whole_plan(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    from qtool.ops.quantize import run

    shown = run(tiny_bf16, dry_run=True, out=tmp_path / "q", recipe=load_recipe(RECIPE), calib_ids=calib_ids)["plan"]
    assert shown["output_shards"] == len(shown["layers"]) + 1  # a shard a layer, and the carried-over one
    assert shown["output_bytes"] > 0

    def fails(p):
        raise PlanError("an output plan that fails", path=p.out)

    monkeypatch.setattr(output_module, "output_plan", fails)
    with pytest.raises(PlanError, match="an output plan that fails"):  # what the run would refuse, a dry run does
        run(tiny_bf16, dry_run=True, out=tmp_path / "q", recipe=load_recipe(RECIPE), calib_ids=calib_ids)
