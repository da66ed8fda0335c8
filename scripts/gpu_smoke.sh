#!/usr/bin/env bash
# GPU checks run on a lent CUDA machine (not in CI): the gpu-marked tests, and `eval kld` on CUDA vs CPU.
# Usage (repo root, qtool importable via PYTHONPATH): bash scripts/gpu_smoke.sh
set -uo pipefail
export QTOOL_CACHE_DIR="${QTOOL_CACHE_DIR:-/tmp/qtool-cache}"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/formats/test_nvfp4_triton.py tests/ops/test_calibrate_kv.py \
  tests/ops/test_quantize_gpu.py 2>&1 | tail -15
python3 - <<'PY'
import json, subprocess, sys
from qtool.fixtures.tiny import FixtureCache
import os
cache = FixtureCache(os.path.join(os.environ["QTOOL_CACHE_DIR"], "fixtures"))
ref, test = cache.path("bf16"), cache.path("nvfp4_modelopt_nomtp")
out = {}
for dev in ("cpu", "cuda"):
    r = subprocess.run([sys.executable, "-m", "qtool", "eval", "kld", "--ref", str(ref), "--test", str(test),
                        "--windows", "2", "--seq-len", "64", "--device", dev, "--json", "--quiet"],
                       capture_output=True, text=True)
    out[dev] = json.loads(r.stdout) if r.returncode == 0 else r.stderr[-800:]
print("eval kld cpu :", out["cpu"])
print("eval kld cuda:", out["cuda"])
if isinstance(out["cpu"], dict) and isinstance(out["cuda"], dict):
    rel = abs(out["cpu"]["mean"] - out["cuda"]["mean"]) / max(out["cpu"]["mean"], 1e-12)
    print(f"mean KLD relative difference cuda vs cpu: {rel:.4%}")
PY
