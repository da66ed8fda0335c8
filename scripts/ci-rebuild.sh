#!/usr/bin/env bash
# Rebuild the artifacts whose upstream changed, verify them, publish their manifests.
#
#   scripts/ci-rebuild.sh [RECIPE.yaml ...]        (default: recipes/build/*.yaml except demo-tiny)
#
# For each recipe: `qtool build --dry-run --json` resolves every Hub source to its current commit and
# computes the step keys; steps whose key has no finished output are the ones to run. Then `qtool build`
# runs exactly those (content-addressed: unchanged steps are skipped), its verify steps included, and the
# final qtool-manifest.json (provenance chain: sources with commits, step keys) is copied to
# $PUBLISH_DIR/<recipe>.manifest.json. Exit status: 0 all built and verified, 3 if any verification
# failed, 1 on any other error (every recipe is still attempted).
#
# Environment: BUILD_ROOT (default build/), PUBLISH_DIR (default $BUILD_ROOT/manifests), QTOOL (default
# `qtool`), HF_TOKEN / HF_ENDPOINT / HF_HUB_CACHE as for huggingface_hub, QTOOL_BUILD_SOURCES to map
# sources to local directories.
set -uo pipefail

QTOOL=${QTOOL:-qtool}
BUILD_ROOT=${BUILD_ROOT:-build}
PUBLISH_DIR=${PUBLISH_DIR:-$BUILD_ROOT/manifests}
mkdir -p "$BUILD_ROOT" "$PUBLISH_DIR"

if [ "$#" -gt 0 ]; then
  recipes=("$@")
else
  recipes=()
  for r in recipes/build/*.yaml; do
    [ "$(basename "$r")" = demo-tiny.yaml ] || recipes+=("$r")
  done
fi

status=0
summary=()
for recipe in "${recipes[@]}"; do
  name=$(basename "$recipe" .yaml)
  out="$BUILD_ROOT/$name"
  plan="$BUILD_ROOT/$name.plan.json"
  if ! $QTOOL build "$recipe" -o "$out" --dry-run --json > "$plan"; then
    echo "::error::$name: planning failed (upstream unreachable, gated, or recipe invalid)"; cat "$plan" >&2
    summary+=("$name: plan failed"); status=$(( status > 1 ? status : 1 )); continue
  fi
  todo=$(python3 -c 'import json,sys; p=json.load(open(sys.argv[1])); print(" ".join(s["id"] for s in p["steps"] if s["state"]=="run"))' "$plan")
  if [ -z "$todo" ] && [ -f "$out/qtool-manifest.json" ]; then
    echo "$name: up to date"; summary+=("$name: up to date")
  else
    echo "$name: rebuilding steps: ${todo:-publish}"
    $QTOOL build "$recipe" -o "$out" --quiet
    rc=$?
    if [ "$rc" -ne 0 ]; then
      if [ "$rc" -eq 3 ]; then echo "::error::$name: verification failed"; else echo "::error::$name: build failed ($rc)"; fi
      summary+=("$name: failed ($rc)"); [ "$rc" -gt "$status" ] && status=$rc; [ "$status" -eq 2 ] && status=1
      continue
    fi
    summary+=("$name: rebuilt (${todo:-publish})")
  fi
  cp "$out/qtool-manifest.json" "$PUBLISH_DIR/$name.manifest.json"
done

printf '%s\n' "${summary[@]}"
exit "$status"
