#!/usr/bin/env bash
# Copies the YAML files of a source folder (their single source) into a folder of the Helm
# chart, each with a GENERATED header; --check says which copies drifted instead. Used by
# hack/sync-chart-crds.sh (CRDs) and hack/policies/sync-chart.sh (admission policies, roles).
#   hack/sync-chart-files.sh SRC DEST TOOL [--check]
# TOOL is how the header and the hint name the command that writes the copies.
set -euo pipefail
cd "$(dirname "$0")/.."
src_dir=$1 chart=$2 tool=$3 mode=${4:-}
status=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for src in "$src_dir"/*.yaml; do
  { echo "# GENERATED from $src by $tool: edit $src instead."; cat "$src"; } \
    > "$tmp/$(basename "$src")"
done
if [ "$mode" = "--check" ]; then
  for f in "$tmp"/*.yaml; do
    name=$(basename "$f")
    if ! cmp -s "$f" "$chart/$name"; then echo "out of date: $chart/$name"; status=1; fi
  done
  for f in "$chart"/*.yaml; do
    [ -e "$f" ] || continue
    [ -e "$tmp/$(basename "$f")" ] || { echo "not in $src_dir/: $f"; status=1; }
  done
  [ $status -eq 0 ] || echo "run: ${tool%% (*}"
  exit $status
fi
mkdir -p "$chart"
rm -f "$chart"/*.yaml
cp "$tmp"/*.yaml "$chart/"
echo "$chart synced from $src_dir/: $(cd "$chart" && ls *.yaml | tr '\n' ' ')"
