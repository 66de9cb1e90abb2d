#!/usr/bin/env bash
# Stages what `bench/extender.py --cluster` needs on the lent GPU machine (no network, none of
# our binaries or Python packages), in one folder DEST (default .devbench, git-ignored) that
# travels in one call: the control plane, etcd and KWOK binaries devcluster starts
# (hack/build-k8s.sh's, tar + xz, cached beside them since compressing takes minutes) and the
# product's Python dependencies installed for CPython PY_VERSION (default 3.12, the GPU
# machine's) on manylinux x86_64, at the versions of this checkout's .venv. Carpool itself is
# not staged: the tracked tree travels with every call and hack/device-bench/run-extender.sh
# installs it there. PY_VERSION=3.11 stages for this machine's python3 (to try the folder here).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST="${1:-.devbench}"
PY_VERSION="${PY_VERSION:-3.12}"
PY="${PY:-.venv/bin/python}"
# devcluster's _require_binaries: what kwokctl's binary runtime and devcluster run
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok kwokctl)
# The bench runs the extender and the test bed: neither imports the device plugin's gRPC
# (grpcio, protobuf), kopf (the operator's host) or NVML.
SKIP='^(kopf|grpcio|protobuf|nvidia-ml-py)\b'
work=$(mktemp -d /tmp/devbench-stage.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST"
rm -f "$DEST"/*

k8s=$(bash hack/build-k8s.sh | tail -1)
cache="$(dirname "$k8s")/../device-bench/$(basename "$k8s")-$(echo "${BINARIES[*]}" | sha256sum | cut -c1-8).tar.xz"
if ! [ -f "$cache" ]; then
  echo "==> [device-bench] compressing ${BINARIES[*]} (xz, once per binary set: minutes)"
  mkdir -p "$(dirname "$cache")"
  tar -C "$(dirname "$k8s")" -cf - "${BINARIES[@]/#/$(basename "$k8s")/}" \
    | nice -n 10 xz -T1 -6 --lzma2=preset=6,dict=192MiB > "$work/bin.tar.xz"
  mv "$work/bin.tar.xz" "$cache"
fi
ln -f "$cache" "$DEST/bin.tar.xz" 2>/dev/null || cp "$cache" "$DEST/bin.tar.xz"
basename "$k8s" > "$DEST/bin-dir"

echo "==> [device-bench] Python dependencies for CPython $PY_VERSION (manylinux x86_64)"
"$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
  | grep -Evi "$SKIP" > "$work/requirements.txt"
printf '%s\n' setuptools wheel >> "$work/requirements.txt"  # to install Carpool's tree there
"$PY" -m pip freeze --exclude-editable > "$work/constraints.txt"
abi="cp${PY_VERSION/./}"
"$PY" -m pip install -q --target "$work/site" --only-binary=:all: --no-compile \
  --python-version "$PY_VERSION" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any -r "$work/requirements.txt" -c "$work/constraints.txt"
rm -rf "$work"/site/bin
tar -C "$work" -cf - site | xz -T2 -9 > "$DEST/site.tar.xz"
echo "$PY_VERSION" > "$DEST/python-version"
(cd "$DEST" && sha256sum bin.tar.xz site.tar.xz > SHA256SUMS)
ls -la "$DEST"
echo "==> [device-bench] $DEST: $(du -sbL "$DEST" | awk '{printf "%.1f MiB", $1/1048576}')"
