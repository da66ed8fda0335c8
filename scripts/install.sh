#!/usr/bin/env bash
# Install qtool and its pinned dependencies into ./.venv (or into $QTOOL_VENV).
# - torch: keeps a torch that the interpreter already has (a GPU box); otherwise installs torch==2.13.0:
#   on a machine without an NVIDIA GPU the CPU build from the PyTorch CPU wheel index ($QTOOL_TORCH_INDEX),
#   since the default index serves the CUDA build (~2 GB of nvidia wheels) there; if that index cannot be
#   reached, pip's configured index (which may itself serve a CPU build, as a mirror often does).
# - everything else: pinned by constraints.txt (the versions qtool is tested against).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${QTOOL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  # A GPU box's preinstalled torch is seen and kept (--system-site-packages), but only where there is one:
  # otherwise the system's other packages would leak in and pip would report their conflicts as errors.
  if "$python" -c 'import torch' 2>/dev/null; then
    "$python" -m venv --system-site-packages "$venv"
  else
    "$python" -m venv "$venv"
  fi
fi
py="$venv/bin/python"
cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
cp "$root/constraints.txt" "$cons"
if torch_version="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"; then
  echo "qtool install: keeping the installed torch $torch_version"
  echo "torch==$torch_version" >> "$cons"
else
  echo "torch==2.13.0" >> "$cons"
  cpu_index="${QTOOL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /proc/driver/nvidia ] && [ -n "$cpu_index" ] &&
     "$py" -m pip install -q --timeout 15 --retries 0 --index-url "$cpu_index" "torch==2.13.0" 2>/dev/null; then
    # (pip may take the wheel from a configured find-links folder or mirror rather than the index)
    echo "qtool install: torch 2.13.0 (CPU build)"
  else
    "$py" -m pip install -q -c "$cons" "torch==2.13.0"
  fi
  if "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null && [ -e /proc/driver/nvidia ]; then
    echo "qtool install: note: this torch is a CPU build on a machine with an NVIDIA GPU" >&2
  fi
fi
"$py" -m pip install -q -c "$cons" -e "$root[quant,test]"
echo "qtool install: done ($("$venv/bin/qtool" --version))"
