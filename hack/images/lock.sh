#!/usr/bin/env bash
# Re-resolves docker/requirements.lock from pyproject's dependencies: the newest wheels for
# CPython 3.11 on manylinux x86_64 that satisfy them (the images install exactly these).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
report=$(mktemp); target=$(mktemp -d); trap 'rm -rf "$report" "$target"' EXIT
mapfile -t deps < <($PY -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
$PY -m pip install -q --dry-run --ignore-installed --only-binary=:all: --python-version 3.11 \
  --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --target "$target" --report "$report" "${deps[@]}"
{
  head -2 docker/requirements.lock
  $PY -c 'import json, sys
r = json.load(open(sys.argv[1]))
for i in sorted(r["install"], key=lambda i: i["metadata"]["name"].lower()):
    print(i["metadata"]["name"] + "==" + i["metadata"]["version"])' "$report"
} > docker/requirements.lock.new
mv docker/requirements.lock.new docker/requirements.lock
