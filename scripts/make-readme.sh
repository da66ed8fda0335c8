#!/usr/bin/env bash
# README.md is generated from docs/: the newcomer's pages (_intro, the walkthrough, the output contract,
# troubleshooting, quality and speed); each command's own page stays in docs/ and is linked from the commands table.
# tests/test_readme.py checks it is current.
set -euo pipefail
cd "$(dirname "$0")/.."
parts=(_intro _walkthrough outputs _troubleshooting _quality)
{
  for p in "${parts[@]}"; do
    [ -f "docs/$p.md" ] || { echo "missing docs/$p.md" >&2; exit 1; }
    cat "docs/$p.md"
    echo
  done
} > README.md
