#!/usr/bin/env bash
# Install qtool and its pinned dependencies into ./.venv (or into $QTOOL_VENV).
# - torch: keeps a torch that the interpreter already has (a GPU box); otherwise installs the CPU build
#   torch==2.13.0, so pip never pulls a multi-GB CUDA build on a CPU machine.
# - everything else: pinned by constraints.txt (the versions qtool is tested against).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${QTOOL_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  # --system-site-packages lets a GPU box's preinstalled torch be seen and kept.
  "$python" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
cp "$root/constraints.txt" "$cons"
if torch_version="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)"; then
  echo "qtool install: keeping the installed torch $torch_version"
  echo "torch==$torch_version" >> "$cons"
else
  echo "torch==2.13.0" >> "$cons"
  "$py" -m pip install -q -c "$cons" "torch==2.13.0"
fi
"$py" -m pip install -q -c "$cons" -e "$root[quant,test]"
echo "qtool install: done ($("$venv/bin/qtool" --version))"
