"""Recipe files as users hand them over (qtool.io.yamlio, qtool.build_with): a FIFO, a device, a Latin-1 byte,
a 5,000-digit number, aliases, a wrong `with` value in a later step. Every one is refused at once by
`qtool build` (and `qtool quantize --recipe`) with exit 2 and a message naming the file and the key, never a
hang or a traceback."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import yaml

from qtool.build_recipes import load_build_recipe
from qtool.cli.main import main
from qtool.io.yamlio import MAX_RECIPE_BYTES

BUILD = """name: bad
sources:
  nv: {path: /nonexistent/nv}
  bf: {path: /nonexistent/bf}
steps:
  - {id: first, op: patch-config, input: nv, with: {fixes: [router-ignore]}}
  - id: later
    op: OP
"""
QUANT = """schema_version: 1
name: bad
groups: {routed_experts: nvfp4}
"""


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """`qtool ARGV` in this process, in a thread so that a hang fails the test instead of the suite."""
    result: dict = {}

    def target() -> None:
        try:
            result["code"] = main(argv)
        except BaseException as e:  # noqa: BLE001 - a traceback is what the test reports
            result["raised"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), f"qtool {' '.join(argv)} hangs"
    assert "raised" not in result, f"traceback: {result.get('raised')!r}"
    captured = capsys.readouterr()
    return result["code"], captured.out + captured.err


def _later_step(tmp_path: Path, op: str, with_yaml: str, input_line: str = "    input: first\n") -> Path:
    p = tmp_path / "bad.yaml"
    text = BUILD.replace("OP", op) + ("" if op == "assemble" else input_line)
    p.write_text(text + (f"    with: {with_yaml}\n" if with_yaml else ""))
    return p


# (op, the later step's `with`, the key the error must name): each a value `--dry-run` never planned
# (the step waits for the first one), which a build met only mid-run, as a traceback
BAD_WITH = [
    ("calibrate-kv", "{samples: four}", "samples"),
    ("calibrate-kv", "{samples: 0}", "samples"),
    ("calibrate-kv", "{samples: true}", "samples"),
    ("calibrate-kv", "{samples: null}", "samples"),
    ("calibrate-kv", "{seq_len: 1.5}", "seq_len"),
    ("calibrate-kv", "{device: tpu}", "device"),
    ("calibrate-kv", "{device: 'cuda:x'}", "device"),
    ("calibrate-kv", "{dataset: 5}", "dataset"),
    ("calibrate-kv", "{replace_scales: 'no'}", "replace_scales"),  # was true: bool("no")
    ("calibrate-kv", "{replace_scales: no}", "replace_scales"),  # YAML 1.1's no: a string here
    ("patch-config", "{fixes: router-ignore}", "fixes"),
    ("patch-config", "{fixes: [router-ignor]}", "fixes"),
    ("patch-config", "{ignore_add: 'model.mtp.*'}", "ignore_add"),
    ("patch-config", "{yarn: -1}", "yarn"),
    ("patch-config", "{yarn: .inf}", "yarn"),
    ("patch-config", "{sampling_defaults: 'yes'}", "sampling_defaults"),
    ("patch-config", "{original_max_position: 0}", "original_max_position"),
    ("verify", "{tp: 0}", "tp"),
    ("verify", "{tp: '4'}", "tp"),
    ("verify", "{engine: vlm}", "engine"),
    ("verify", "{gpus: 4x96}", "gpus"),
    ("verify", "{kv_cache_dtype: fp16}", "kv_cache_dtype"),
    ("verify", "{gpu_memory_utilization: 1.5}", "gpu_memory_utilization"),
    ("verify", "{mtp: -1}", "mtp"),
    ("verify", "{deep: 'false'}", "deep"),
    ("assemble", "{nvfp4: nv, bf16: bf, bf16_expert_layers: 0}", "bf16_expert_layers"),
    ("assemble", "{nvfp4: nv, bf16: bf, bf16_expert_layers: [-1]}", "bf16_expert_layers"),
    ("assemble", "{nvfp4: nv, bf16: bf, mtp: maybe}", "mtp"),
    ("assemble", "{nvfp4: nv, bf16: bf, max_shard_size: lots}", "max_shard_size"),
    ("assemble", "{nvfp4: nv, bf16: bf, link: symlink}", "link"),
    ("assemble", "{nvfp4: [nv], bf16: bf}", "nvfp4"),
    ("convert", "{to: ct}", "to"),
    ("convert", "", "to"),
    ("quantize", "{recipe: qwen35-nvfp4-experts, backend: gptq}", "backend"),
    ("quantize", "{recipe: qwen35-nvfp4-experts, format: awq2}", "format"),
    ("quantize", "{samples: 4}", "recipe"),
    ("download", "{include: '*.json'}", "include"),
    ("verify", "0", "with"),
    ("verify", "[tp, 4]", "with"),
]


@pytest.mark.parametrize("op,with_yaml,key", BAD_WITH, ids=[f"{o}-{w or 'none'}" for o, w, _ in BAD_WITH])
def test_a_later_steps_bad_with_is_refused_by_dry_run(tmp_path, capsys, op, with_yaml, key):
    recipe = _later_step(tmp_path, op, with_yaml)
    code, out = _run(["build", str(recipe), "--dry-run", "-o", str(tmp_path / "o")], capsys)
    assert code == 2, out
    assert str(recipe) in out and key in out and "step 'later'" in out, out
    assert not (tmp_path / "o.build").exists()


def test_a_quantize_steps_recipe_is_loaded_with_the_build_recipe(tmp_path, capsys):
    recipe = _later_step(tmp_path, "quantize", "{recipe: qwen35-nvfp4-experts-typo}")
    code, out = _run(["build", str(recipe), "--dry-run"], capsys)
    assert code == 2 and "no such recipe" in out and "qwen35-nvfp4-experts-typo" in out, out


def test_the_json_error_names_the_key(tmp_path, capsys):
    recipe = _later_step(tmp_path, "calibrate-kv", "{samples: four}")
    code, out = _run(["build", str(recipe), "--dry-run", "--json"], capsys)
    err = json.loads(out)
    assert code == 2 and err["error"] == "BuildRecipeError" and "with.samples" in err["message"]
    assert err["path"] == str(recipe) and err["got"] == "'four'"


def _fifo(tmp_path: Path) -> Path:
    p = tmp_path / "recipe.yaml"
    os.mkfifo(p)
    return p


def _dev_zero(tmp_path: Path) -> Path:
    p = tmp_path / "recipe.yaml"
    p.symlink_to("/dev/zero")
    return p


def _file(data: bytes):
    def make(tmp_path: Path) -> Path:
        p = tmp_path / "recipe.yaml"
        p.write_bytes(data)
        return p

    return make


def _laughs(depth: int = 9) -> bytes:
    """The billion laughs: 1 KB of nested aliases that expand to 10**depth strings."""
    lines = ['a0: &a0 "lol"']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, depth + 1)]
    return ("\n".join(lines) + "\n").encode()


GOOD_BUILD = BUILD.encode().replace(b"OP", b"verify") + b"    input: first\n"

# (file maker, what the message must say)
BAD_FILES = {
    "fifo": (_fifo, "is a FIFO"),
    "dev-zero-link": (_dev_zero, "not a regular file"),
    "latin1-byte": (_file(GOOD_BUILD.replace(b"name: bad", b"name: caf\xe9")), "byte 0xe9 at line 1, column 10"),
    "5000-digit-number": (_file(GOOD_BUILD + b"    with: {tp: " + b"9" * 5000 + b"}\n"), "a number of 5000"),
    "5000-digit-float": (
        _file(GOOD_BUILD + b"    with: {gpu_memory_utilization: 0." + b"9" * 5000 + b"}\n"),
        "a number of 5002",
    ),
    "recursive-alias": (_file(b"a: &a [*a]\n"), "anchor &a"),
    "alias": (
        _file(
            GOOD_BUILD.replace(b"with: {fixes: [router-ignore]}", b"with: &w {fixes: [router-ignore]}")
            + b"    with: *w\n"
        ),
        "anchor &w",
    ),
    "billion-laughs": (_file(_laughs()), "anchor &a0"),
    "oversized": (_file(GOOD_BUILD + b"#" * MAX_RECIPE_BYTES + b"\n"), "larger than"),
    "deeply-nested": (_file(b"name: " + b"[" * 20000 + b"]" * 20000 + b"\n"), "nested too deeply"),
    "not-yaml": (_file(b"name: [unclosed\n"), "not valid YAML"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_build_recipe_file_is_refused_at_once(tmp_path, capsys, case):
    make, needle = BAD_FILES[case]
    recipe = make(tmp_path)
    code, out = _run(["build", str(recipe), "--dry-run"], capsys)
    assert code == 2, out
    assert str(recipe) in out and needle in out, out


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_quantization_recipe_file_is_refused_at_once(tmp_path, capsys, case):
    """quantize reads its recipe through the same loader: the same refusals, before the checkpoint is read."""
    make, needle = BAD_FILES[case]
    recipe = make(tmp_path)
    code, out = _run(
        ["quantize", str(tmp_path / "no-checkpoint"), "--recipe", str(recipe), "-o", str(tmp_path / "o"), "--dry-run"],
        capsys,
    )
    assert code == 2, out
    assert str(recipe) in out and needle.replace("build recipe", "recipe") in out, out


@pytest.mark.parametrize(
    "bad,needle",
    [
        (QUANT + "int4: {awq: 'no'}\n", "int4.awq"),
        (QUANT + "calibration: {dataset: builtin, samples: true, seq_len: 8}\n", "calibration"),
        (QUANT.replace("schema_version: 1", "schema_version: true"), "schema_version"),
        (QUANT + "layer_overrides: {true: {routed_experts: bf16}}\n", "layer_overrides"),
        (QUANT + "kv_cache: [fp8]\n", "kv_cache"),
        (QUANT + "1: x\nz: y\n", "unknown recipe keys"),
    ],
)
def test_a_quantization_recipes_values_are_typed(tmp_path, capsys, bad, needle):
    recipe = tmp_path / "q.yaml"
    recipe.write_text(bad)
    code, out = _run(
        ["quantize", str(tmp_path / "no-checkpoint"), "--recipe", str(recipe), "-o", str(tmp_path / "o"), "--dry-run"],
        capsys,
    )
    assert code == 2 and needle in out and str(recipe) in out, out


@pytest.mark.parametrize(
    "argv",
    [
        ["build", "no-such-build-recipe"],
        ["build", "missing/recipe.yaml"],
        ["quantize", "ckpt", "--recipe", "no-such-recipe", "-o", "o"],
        ["quantize", "ckpt", "--recipe", "missing/recipe.yaml", "-o", "o"],
        ["recipes", "show", "no-such-recipe"],
    ],
)
def test_an_unknown_recipe_is_a_usage_error_everywhere(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, out = _run(argv, capsys)
    assert code == 2 and "fix:" in out, out


def test_a_missing_source_path_says_how_to_fix_it(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BUILD.replace("OP", "verify") + "    input: first\n")
    code, out = _run(["build", str(recipe), "--dry-run"], capsys)
    assert code == 1 and "/nonexistent/nv" in out and "fix:" in out and "--source nv=" in out, out


def test_yaml_1_2_booleans_and_strings():
    """true/false are booleans; yes/no/on/off stay the strings they read as (a `with` value that expects a
    boolean then names its key, as above)."""
    from qtool.io.yamlio import _RecipeLoader

    assert yaml.load("[true, False, no, off, 'yes', 0x10]", Loader=_RecipeLoader) == [
        True,
        False,
        "no",
        "off",
        "yes",
        16,
    ]


def test_shipped_build_recipes_load_through_the_strict_loader():
    from qtool.build_recipes import shipped_build_recipes

    for name, path in shipped_build_recipes().items():
        assert load_build_recipe(path).name == name


def test_every_with_key_takes_its_values(tmp_path):
    """The schema refuses only what the ops refuse: a recipe that gives every key a valid value (null where
    the option's default is None, as plan hybrid writes them) loads."""
    recipe = tmp_path / "all.yaml"
    recipe.write_text("""name: all
sources:
  nv: {hub: org/nv, revision: "0123"}
  bf: {hub: org/bf, tensors: assemble}
steps:
  - {id: dl, op: download, input: nv, with: {include: ["*.json"], tensors: ["model.layers.0.*"]}}
  - id: hybrid
    op: assemble
    with: {nvfp4: dl, bf16: bf, bf16_expert_layers: [0, 3], bf16_shared_expert_layers: null, mtp: from-bf16,
           link: hardlink, max_shard_size: 5GB}
  - {id: ct, op: convert, input: hybrid, with: {to: compressed-tensors}}
  - {id: q, op: quantize, input: bf, with: {recipe: qwen35-awq-int4, backend: rtn, format: awq, samples: null,
                                           seq_len: 16, dataset: builtin, device: "cuda:1"}}
  - {id: kv, op: calibrate-kv, input: ct, with: {samples: 2, seq_len: 8, device: cuda, replace_scales: false}}
  - id: patched
    op: patch-config
    input: kv
    with: {fixes: [router-ignore, mtp-ignore], ignore_add: ["a.*"], ignore_remove: [], yarn: 4,
           original_max_position: 262144, sampling_defaults: true}
  - id: check
    op: verify
    input: patched
    with: {engine: "vllm@0.17,sglang", tp: 4, gpus: 4x96GiB, max_model_len: null, max_num_seqs: 8,
           kv_cache_dtype: fp8, mtp: 0, deep: false, gpu_memory_utilization: 0.85}
""")
    r = load_build_recipe(recipe)
    assert [s.id for s in r.steps] == ["dl", "hybrid", "ct", "q", "kv", "patched", "check"]
    assert r.sources["nv"].revision == "0123" and r.step("hybrid").inputs == ("bf", "dl")
