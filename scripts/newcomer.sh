#!/usr/bin/env bash
# A newcomer's run, as CI does it on a fresh clone: the README's two set-up commands exactly as the README
# writes them (read from README.md, so a change there is what runs here): the demo end to end, then the
# tests. The tests carry the rest of a newcomer's first hour: every walkthrough line against the fake Hub
# (tests/hub/test_walkthrough.py) and the wheel in a fresh venv with the demo from another directory
# (tests/test_packaging.py).
#   bash scripts/newcomer.sh           # run them
#   bash scripts/newcomer.sh --print   # only print them, one per line
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t commands < <(python3 - <<'PY'
import re
text = open("README.md").read()
setup = text.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
for command in re.findall(r"```\n(.*?)\n```", setup, flags=re.S):
    print(command)
PY
)
if [ "${#commands[@]}" -ne 2 ]; then
  echo "newcomer: README.md's set-up section has ${#commands[@]} commands, not 2" >&2
  exit 1
fi
if [ "${1:-}" = "--print" ]; then
  printf '%s\n' "${commands[@]}"
  exit 0
fi
for command in "${commands[@]}"; do
  echo "newcomer: \$ $command"
  start=$SECONDS
  bash -c "$command"
  echo "newcomer: done in $((SECONDS - start)) s"
done
