"""qtool serve-config: exact flags for both engines and both formats, refusal with exit 3."""

from __future__ import annotations

import json
import shlex

from qtool.cli.main import main
from qtool.fixtures.tiny import make_broken
from qtool.ops.serve_config import OutputFormat, ServeOptions, plan, render


def _pairs(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out[a] = nxt
    return out


def test_vllm_shell_modelopt_mtp_fp8(tiny_nvfp4_modelopt):
    opts = ServeOptions(engine="vllm", tp=2, mtp=2, port=5000)
    launch = plan(tiny_nvfp4_modelopt, opts)
    f = _pairs(launch.argv)
    assert launch.argv[:3] == ["vllm", "serve", str(tiny_nvfp4_modelopt)]
    assert f["--quantization"] == "modelopt_fp4"
    assert f["--kv-cache-dtype"] == "fp8"  # calibrated scales exist
    assert f["--tensor-parallel-size"] == "2" and f["--port"] == "5000"
    assert json.loads(f["--speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 2}
    assert f["--mm-encoder-tp-mode"] == "data" and "--language-model-only" not in f
    assert f["--reasoning-parser"] == "qwen3" and f["--tool-call-parser"] == "qwen3_coder"
    assert "--enable-auto-tool-choice" in f
    assert f["--max-model-len"] == "4096"  # tiny max_position_embeddings
    assert launch.env["NCCL_P2P_LEVEL"] == "PHB" and launch.env["NCCL_IB_DISABLE"] == "1"
    text = render(launch, opts)
    assert text.startswith("NCCL_P2P_LEVEL=PHB NCCL_IB_DISABLE=1 ")
    assert shlex.split(text.replace("\\\n", " "))[5:] == launch.argv  # 5 env assignments, then the command


def test_vllm_old_version_mtp_method(tiny_nvfp4_modelopt):
    f = _pairs(plan(tiny_nvfp4_modelopt, ServeOptions(engine="vllm@0.16", tp=2, mtp=1)).argv)
    assert json.loads(f["--speculative-config"])["method"] == "qwen3_next_mtp"


def test_sglang_compose_ct_no_kv_scales(tiny_nvfp4_ct):
    opts = ServeOptions(engine="sglang", tp=2, mtp=3, port=30000, format=OutputFormat.COMPOSE)
    launch = plan(tiny_nvfp4_ct, opts)
    f = _pairs(launch.argv)
    assert launch.argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert f["--model-path"] == "/model"
    assert "--quantization" not in f  # compressed-tensors is auto-detected
    assert "--kv-cache-dtype" not in f  # no k/v scales: BF16 KV cache
    assert (
        f["--speculative-algorithm"],
        f["--speculative-num-steps"],
        f["--speculative-eagle-topk"],
        f["--speculative-num-draft-tokens"],
    ) == ("NEXTN", "3", "1", "4")
    assert f["--mamba-scheduler-strategy"] == "extra_buffer"  # VLM format
    assert f["--tp-size"] == "2" and f["--context-length"] == "4096"
    assert launch.env["SGLANG_ENABLE_SPEC_V2"] == "True"
    text = render(launch, opts)
    assert '      - "30000:30000"' in text and f'      - "{tiny_nvfp4_ct}:/model:ro"' in text
    assert "              count: 2" in text
    entry = text.split("    entrypoint:\n")[1].split("    restart:")[0]
    assert [json.loads(line.strip()[2:]) for line in entry.splitlines()] == launch.argv


def test_sglang_shell_modelopt_yarn(tiny_nvfp4_modelopt):
    launch = plan(tiny_nvfp4_modelopt, ServeOptions(engine="sglang", tp=2, yarn=4.0))
    f = _pairs(launch.argv)
    assert f["--quantization"] == "modelopt_fp4" and f["--kv-cache-dtype"] == "fp8_e4m3"
    assert f["--context-length"] == str(4 * 4096)
    rope = json.loads(f["--json-model-override-args"])["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 4096
    assert "--speculative-algorithm" not in f and "SGLANG_ENABLE_SPEC_V2" not in launch.env


def test_vllm_compose_and_language_model_only_without_vision(tiny_nvfp4_modelopt_nomtp, capsys):
    # nomtp still has the vision tower; --mtp on it is refused (mtp-missing), so no MTP flags here
    assert (
        main(
            [
                "serve-config",
                str(tiny_nvfp4_modelopt_nomtp),
                "--engine",
                "vllm",
                "--tp",
                "2",
                "--format",
                "compose",
                "--max-num-seqs",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"vllm/vllm-openai:v0.33.0"' in out and '      - "--max-num-seqs"\n      - "8"' in out
    assert '"--mm-encoder-tp-mode"' in out and "speculative" not in out


def test_refuses_broken_and_unservable(tiny_nvfp4_modelopt, tiny_nvfp4_modelopt_nomtp, tmp_path, capsys):
    bad = make_broken(tiny_nvfp4_modelopt, tmp_path / "b", "missing_tensor")
    assert main(["serve-config", str(bad), "--engine", "vllm", "--tp", "2"]) == 3
    err = capsys.readouterr()
    assert "refusing" in err.err and "missing-tensor" in err.err and "vllm serve" not in err.out
    assert main(["serve-config", str(tiny_nvfp4_modelopt_nomtp), "--engine", "sglang", "--tp", "2", "--mtp", "2"]) == 3
    assert "mtp-missing" in capsys.readouterr().err
    assert main(["serve-config", str(tiny_nvfp4_modelopt), "--engine", "vllm"]) == 3  # TP 4: tp-divisibility
