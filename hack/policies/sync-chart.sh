#!/usr/bin/env bash
# Copies the policies in hack/policies/ (their single source) into the Helm chart's
# files/policies/, which templates/policies.yaml reads with .Files.Get (Helm reads only files
# inside the chart). The template renames the objects after the release and fills the
# pod-annotation policy's `writers` with the release's accounts; nothing else changes.
# tests/unit/test_helm_render.py fails when the copies drift.
#   hack/policies/sync-chart.sh           write the copies
#   hack/policies/sync-chart.sh --check   exit 1 (and say which) if a copy differs or is missing
set -euo pipefail
cd "$(dirname "$0")/../.."
chart=helm/carpool/files/policies
header() { echo "# GENERATED from $1 by hack/policies/sync-chart.sh: edit $1 instead."; }
status=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for src in hack/policies/*.yaml; do
  { header "$src"; cat "$src"; } > "$tmp/$(basename "$src")"
done
if [ "${1:-}" = "--check" ]; then
  for f in "$tmp"/*.yaml; do
    name=$(basename "$f")
    if ! cmp -s "$f" "$chart/$name"; then echo "out of date: $chart/$name"; status=1; fi
  done
  for f in "$chart"/*.yaml; do
    [ -e "$f" ] || continue
    [ -e "$tmp/$(basename "$f")" ] || { echo "not in hack/policies/: $f"; status=1; }
  done
  [ $status -eq 0 ] || echo "run: bash hack/policies/sync-chart.sh"
  exit $status
fi
mkdir -p "$chart"
rm -f "$chart"/*.yaml
cp "$tmp"/*.yaml "$chart/"
echo "chart policies synced from hack/policies/: $(cd "$chart" && ls *.yaml | tr '\n' ' ')"
