#!/usr/bin/env bash
# README.md is generated from docs/ (one section per command); tests/test_readme.py checks it is current.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=(_intro outputs inspect patch-config assemble-hybrid calibrate-kv quantize convert nvfp4-gpu verify serve-config
       eval-kld download build _dev)
{
  for p in "${parts[@]}"; do
    [ -f "docs/$p.md" ] || { echo "missing docs/$p.md" >&2; exit 1; }
    cat "docs/$p.md"
    echo
  done
} > README.md
