"""One finding type (qtool.findings.Finding) made where a problem is found and consumed as data."""

from __future__ import annotations

import shutil

from qtool.arch.model_map import build_map
from qtool.findings import Code, Finding
from qtool.io.checkpoint import Checkpoint
from qtool.io.quant_config import summarize
from qtool.ops.checks import check_structure
from qtool.ops.inspect import find_problems
from qtool.ops.verify import VerifyOptions, verify


def test_structure_findings_name_the_tensor_without_parsing_messages(tiny_nvfp4_modelopt, tmp_path):
    from checkpoint_edits import drop_tensors

    ck = tmp_path / "c"
    shutil.copytree(tiny_nvfp4_modelopt, ck)
    gone = "model.language_model.layers.1.linear_attn.A_log"
    drop_tensors(ck, lambda n: n == gone)
    res = check_structure(build_map(Checkpoint.open(ck)))
    found = [Finding.from_json(d) for d in res["findings"]]
    assert [(f.code, f.module) for f in found] == [(Code.MISSING_TENSOR, gone)]
    assert res["problems"] == [f.message for f in found] and not res["ok"]
    rep = verify(ck, VerifyOptions(tp=1))
    assert any(f.code is Code.MISSING_TENSOR and f.module == gone for f in rep.findings)


def test_inspect_problems_are_findings(tiny_nvfp4_modelopt_nomtp):
    mm = build_map(Checkpoint.open(tiny_nvfp4_modelopt_nomtp))
    probs = find_problems(mm, summarize(mm.ckpt.config, mm.ckpt.hf_quant_config))
    assert all(isinstance(p, Finding) for p in probs)
    for p in probs:
        assert Finding.from_json(p.to_json()) == p
