"""quantize's output check (find_problems) made on the plan's view of its output while the layers are
written (qtool.ops.checks.PlannedProblems), with the scale values read back from the written shards and
every shard's header compared with the planned one: what the check catches, and that the end does not
open the written output again (2.4 s after the 397B's last layer)."""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path

import pytest

from qtool.errors import VerificationError
from qtool.io.checkpoint import Checkpoint
from qtool.io.safetensors_header import read_header
from qtool.ops.checks import PlannedProblems
from qtool.recipes import load_recipe

execute = importlib.import_module("qtool.ops.quantize.execute")  # the package exports execute()


def _quantize(src, out, calib_ids):
    from qtool.ops.quantize import run

    return run(src, out=out, recipe=load_recipe("qwen35-nvfp4-experts"), calib_ids=calib_ids)


def _failed_checks(out: Path) -> list[dict]:
    """The problems the manifest of an output left unpublished records."""
    partial = out.with_name(out.name + ".partial")
    assert not out.exists() and partial.is_dir()
    man = json.loads((partial / "qtool-manifest.json").read_text())
    assert man["checks"]["passed"] is False
    return man["checks"]["inspect_problems"]


def test_the_end_does_not_open_the_written_output_again(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    opened = []
    real_open = Checkpoint._open.__func__

    def spy(cls, path, **kw):
        opened.append(Path(path).resolve())
        return real_open(cls, path, **kw)

    monkeypatch.setattr(Checkpoint, "_open", classmethod(spy))
    import qtool.io.plan

    views = []
    make_view = qtool.io.plan.header_checkpoint
    for module in (qtool.io.plan, importlib.import_module("qtool.ops.quantize.output")):
        monkeypatch.setattr(module, "header_checkpoint", lambda *a, **kw: views.append(a[0]) or make_view(*a, **kw))
    out = tmp_path / "q"
    rep = _quantize(tiny_bf16, out, calib_ids)
    assert rep["output"]["problems"] == []
    assert [p for p in opened if p.name.startswith(out.name)] == []
    assert views == [out.with_name("q.partial")]  # the planner's view of the output, checked too
    man = json.loads((out / "qtool-manifest.json").read_text())
    assert man["checks"] == {"inspect_problems": [], "passed": True, "summary": None}


def test_a_scale_written_unlike_its_twin_fails_the_check(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """The gate/up global scales are read back from the written shard, not taken from the plan."""
    produce = execute.calibrate_and_write

    def then_corrupt(p, partial, *args, **kwargs):
        rep = produce(p, partial, *args, **kwargs)
        shard = partial / p.layers[0].shard
        h = read_header(shard)
        name = next(n for n in h.tensors if n.endswith("experts.0.up_proj.weight_scale_2"))
        with open(shard, "r+b") as f:
            f.seek(h.tensors[name].start)
            f.write(struct.pack("<f", 12345.0))
        return rep

    monkeypatch.setattr(execute, "calibrate_and_write", then_corrupt)
    out = tmp_path / "q"
    with pytest.raises(VerificationError, match="failed its checks"):
        _quantize(tiny_bf16, out, calib_ids)
    assert [p["code"] for p in _failed_checks(out)] == ["scale-mismatch"]


def test_a_config_unlike_the_tensors_fails_the_check(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """The structure's problems are found on the plan's view: here its configs leave lm_head (BF16) out of
    their ignore lists."""
    import qtool.ops.quantize.configs as configs

    made = configs.quant_configs

    def without_lm_head(*args, **kwargs):
        qc, hq = made(*args, **kwargs)
        qc["ignore"] = [g for g in qc["ignore"] if "lm_head" not in g]
        hq["quantization"]["exclude_modules"] = [g for g in hq["quantization"]["exclude_modules"] if "lm_head" not in g]
        return qc, hq

    monkeypatch.setattr(configs, "quant_configs", without_lm_head)
    # found at the end, as a job shorter than the check's thread finds it (the early stop: the test below)
    monkeypatch.setattr(PlannedProblems, "found_early", lambda self: [])
    out = tmp_path / "q"
    with pytest.raises(VerificationError, match="failed its checks"):
        _quantize(tiny_bf16, out, calib_ids)
    problems = _failed_checks(out)
    assert {p["code"] for p in problems} == {"bf16-but-not-ignored"} and "lm_head" in problems[0]["message"]


def test_a_carried_over_shard_written_unlike_its_plan_is_refused(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """The checks stand for the written output because every shard holds the header the plan promised:
    the carried-over ones (embeddings, lm_head) are compared too."""
    import qtool.io.apply as apply

    compare = apply.check_written

    def corrupt_first(plan, partial, *args, **kwargs):
        rest = partial / "model-rest-00000.safetensors"
        raw = bytearray(rest.read_bytes())
        i = raw.index(b"embed_tokens")
        raw[i : i + 12] = b"embed_tokenZ"
        rest.write_bytes(bytes(raw))
        monkeypatch.setattr(apply, "check_written", compare)
        return compare(plan, partial, *args, **kwargs)

    monkeypatch.setattr(apply, "check_written", corrupt_first)
    out = tmp_path / "q"
    with pytest.raises(VerificationError, match="not what the plan promised") as e:
        _quantize(tiny_bf16, out, calib_ids)
    assert "model-rest-00000.safetensors" in str(e.value.path)


@pytest.mark.parametrize("wrong", ["written", "planned"])
def test_an_index_one_entry_short_is_refused(tiny_bf16, calib_ids, tmp_path, monkeypatch, wrong):
    """The written index (and configs) stand for the planned ones the checks used: their bytes are compared,
    and the planned index must map exactly the planned shards' tensors (a streamed 397B index is ~40 MB of
    hand-written JSON: qtool.io.writer.index_text)."""
    import qtool.io.apply as apply
    import qtool.io.writer as writer

    owner, name = (apply, "index_text_of") if wrong == "written" else (writer, "index_text")
    real_text = getattr(owner, name)

    def one_entry_short(*args):
        text = "".join(real_text(*args))
        first = text.index('"weight_map": {\n') + len('"weight_map": {\n')  # its first entry's line, dropped
        return iter([text[:first] + text[text.index("\n", first) + 1 :]])

    monkeypatch.setattr(owner, name, one_entry_short)
    out = tmp_path / "q"
    with pytest.raises(
        VerificationError, match="not what the plan promised" if wrong == "written" else "planned index does not map"
    ) as e:
        _quantize(tiny_bf16, out, calib_ids)
    assert str(e.value.path).endswith("model.safetensors.index.json")


def test_a_config_field_of_the_wrong_type_is_refused(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """What Checkpoint.open checks of a config's types is checked of the planned ones."""
    import qtool.ops.quantize.configs as configs

    made = configs.quant_configs

    def wrong_type(*args, **kwargs):
        qc, hq = made(*args, **kwargs)
        return {**qc, "quant_method": 7}, hq

    monkeypatch.setattr(configs, "quant_configs", wrong_type)
    from qtool.errors import ConfigError

    with pytest.raises(ConfigError, match="quant_method"):
        _quantize(tiny_bf16, tmp_path / "q", calib_ids)


def test_a_structure_problem_stops_the_job_at_the_next_layer(tiny_bf16, calib_ids, tmp_path, monkeypatch):
    """The structure's problems are known a layer or two into the job (a wrong plan: a qtool bug); the job
    stops there with the problem, not after its last layer (an hour later at the 397B)."""
    import threading

    import qtool.ops.inspect
    from qtool.findings import Code, error

    layer_module = importlib.import_module("qtool.ops.quantize.layer")
    found = threading.Event()
    real_problems = qtool.ops.inspect.structure_problems

    def planted(mm, summary):
        problems = real_problems(mm, summary) + [
            error(Code.MISSING_TENSOR, "model.language_model.layers.0", "a planted problem")
        ]
        found.set()
        return problems

    written = []
    real_write = layer_module.write_layer_shard

    def write(path, lp, *a, **k):
        if lp.index >= 2:
            assert found.wait(60)  # the check has (all but) found it before the third layer is written
        written.append(lp.index)
        return real_write(path, lp, *a, **k)

    before = set(threading.enumerate())
    monkeypatch.setattr(qtool.ops.inspect, "structure_problems", planted)
    monkeypatch.setattr(layer_module, "write_layer_shard", write)
    out = tmp_path / "q"
    with pytest.raises(VerificationError, match="the planned output has 1 problem") as e:
        _quantize(tiny_bf16, out, calib_ids)
    assert "missing-tensor: a planted problem" in str(e.value.got)
    assert len(written) < 8 and not out.exists()  # of the tiny model's 8 layers
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive() and t.name.startswith("qtool-")]
    assert left == []
    journal = json.loads((tmp_path / "q.partial" / ".quantize" / "journal.json").read_text())
    assert journal["next_layer"] <= max(written)  # the layer it stopped at is not journaled as done
    # (the bug mended) a --resume finishes it, as a run that never stopped would have
    monkeypatch.undo()
    from qtool.ops.quantize import run

    rep = run(tiny_bf16, out=out, recipe=load_recipe("qwen35-nvfp4-experts"), calib_ids=calib_ids, resume=True)
    assert rep["output"]["problems"] == [] and rep["resumed_from_layer"] == journal["next_layer"]
    _quantize(tiny_bf16, tmp_path / "ref", calib_ids)
    for f in sorted(p.name for p in (tmp_path / "ref").glob("*.safetensors")):
        assert (out / f).read_bytes() == (tmp_path / "ref" / f).read_bytes(), f
