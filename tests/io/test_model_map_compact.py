"""The architecture map keeps no per-tensor objects: roles and module parameters are made on demand and
must be what classifying each tensor and grouping them by module gives."""

from __future__ import annotations

import pytest

from qtool.arch.model_map import Format, build_map, module_format
from qtool.arch.qwen35 import KV_SCALE_PARAMS, Group, classify, detect_naming
from qtool.io.checkpoint import Checkpoint


@pytest.mark.parametrize("fixture", ["tiny_nvfp4_modelopt", "tiny_nvfp4_ct", "tiny_bf16_fused"])
def test_roles_and_params_as_classified(fixture, request):
    ck = Checkpoint.open(request.getfixturevalue(fixture))
    mm = build_map(ck)
    naming = detect_naming(ck.tensors)
    assert list(mm.roles) == list(ck.tensors) and len(mm.roles) == len(ck.tensors)
    by_module: dict[str, dict] = {}
    for name, info in ck.tensors.items():
        role = mm.roles[name]
        assert mm.roles.get(name) == role and name in mm.roles
        want = classify(name, naming)
        if role.param not in KV_SCALE_PARAMS:
            # a module's tensors share its classification (made from its first tensor)
            want = classify(role.module + "." + role.param if role.module else name, naming)
        assert role == want
        by_module.setdefault(role.module, {})[role.param] = info
    assert dict(mm.roles.items()) == {n: mm.roles[n] for n in ck.tensors}
    assert mm.roles.get("no.such.tensor") is None and "no.such.tensor" not in mm.roles
    with pytest.raises(KeyError):
        mm.roles["no.such.tensor"]
    assert set(mm.modules) == set(by_module)
    for name, mod in mm.modules.items():
        assert mod.params == by_module[name]
        assert mod.format == module_format(by_module[name])
    formats = {m.format for m in mm.modules.values()}
    assert formats & {Format.NVFP4, Format.NVFP4_CT, Format.BF16}


@pytest.mark.parametrize("fixture", ["tiny_nvfp4_modelopt", "tiny_nvfp4_ct", "tiny_bf16_fused"])
def test_shortcuts_agree_with_a_role_per_tensor(fixture, request, tmp_path):
    """The map's and checkpoint's shortcuts (no role or TensorInfo per tensor: plans ask them of the 397B's
    ~370k tensors) give what asking every tensor gives."""
    ck = Checkpoint.open(request.getfixturevalue(fixture))
    mm = build_map(ck)
    assert mm.kv_scale_tensors() == sorted(n for n, r in mm.roles.items() if r.group is Group.KV_SCALE)
    for g in Group:
        assert mm.has_group(g) == any(r.group is g for r in mm.roles.values()), g
    assert ck.weight_map() == {n: ck.shard_of(n) for n in ck.tensors}
    assert ck.total_bytes() == sum(i.nbytes for i in ck.tensors.values())
    # the files a layer-streamed job hashes from its reads: those its layers' reads and the embedding touch
    from qtool.stream.dequant import layer_tensors
    from qtool.stream.layer_stream import streamed_files

    read = {i.file for idx in range(mm.num_layers) for i in layer_tensors(mm, idx)}
    embed = [i.file for n, i in ck.tensors.items() if n.endswith("language_model.embed_tokens.weight")]
    assert streamed_files(ck, mm) == streamed_files(ck) == read | set(embed) and embed
