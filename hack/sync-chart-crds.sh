#!/usr/bin/env bash
# Copies the CRDs from crds/ (their single source of truth) into the Helm chart's crds/.
# Helm installs a chart's crds/ files as they are, so they must be real files in the chart, not
# templates or symlinks; tests/unit/test_helm_render.py fails when the copies drift.
#   hack/sync-chart-crds.sh           write the copies
#   hack/sync-chart-crds.sh --check   exit 1 (and say which) if a copy differs or is missing
set -euo pipefail
cd "$(dirname "$0")/.."
chart=helm/carpool/crds
header() { echo "# GENERATED from $1 by hack/sync-chart-crds.sh (make chart-crds): edit $1 instead."; }
status=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for src in crds/*.yaml; do
  { header "$src"; cat "$src"; } > "$tmp/$(basename "$src")"
done
if [ "${1:-}" = "--check" ]; then
  for f in "$tmp"/*.yaml; do
    name=$(basename "$f")
    if ! cmp -s "$f" "$chart/$name"; then echo "out of date: $chart/$name"; status=1; fi
  done
  for f in "$chart"/*.yaml; do
    [ -e "$f" ] || continue
    [ -e "$tmp/$(basename "$f")" ] || { echo "not in crds/: $f"; status=1; }
  done
  [ $status -eq 0 ] || echo "run: make chart-crds"
  exit $status
fi
mkdir -p "$chart"
rm -f "$chart"/*.yaml
cp "$tmp"/*.yaml "$chart/"
echo "chart CRDs synced from crds/: $(cd "$chart" && ls *.yaml | tr '\n' ' ')"
