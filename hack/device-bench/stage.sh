#!/usr/bin/env bash
# Stages what `bench/extender.py --cluster` needs on an offline GPU machine (no network, none of
# our binaries or Python packages), in one folder DEST (default .devbench, git-ignored) that
# travels in one call: the control plane, etcd and KWOK binaries devcluster starts
# (hack/build-k8s.sh's, tar + xz, cached beside them since compressing takes minutes) and the
# product's Python dependencies installed for CPython PY_VERSION (default 3.12, the GPU
# machine's) on manylinux x86_64, at the versions of this checkout's .venv. Carpool itself is
# not staged: the tracked tree travels with every call and hack/device-bench/run-extender.sh
# installs it there with that machine's own setuptools. PY_VERSION=3.11 stages for this
# machine's python3 (to try the folder here).
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST="${1:-.devbench}"
PY_VERSION="${PY_VERSION:-3.12}"
PY="${PY:-.venv/bin/python}"
read -ra BINARIES <<< "$("$PY" -c 'from carpool_testbed.devcluster import REQUIRED_BINARIES as b; print(*b)')"
[ ${#BINARIES[@]} -gt 0 ] || { echo "error: no REQUIRED_BINARIES from carpool_testbed.devcluster" >&2; exit 1; }
# x86 branch conversion before LZMA2, whose dictionary spans all seven (they share much of their
# code): 55.1 MB, 0.9 less than xz -6 alone, which counts within the call's 64 MiB; 10 minutes, once.
XZ=(--x86 --lzma2=preset=9,dict=512MiB)
# The bench runs the extender and the test bed: neither imports the device plugin's gRPC
# (grpcio, protobuf), kopf (the operator's host) or NVML.
SKIP='^(kopf|grpcio|protobuf|nvidia-ml-py)\b'
work=$(mktemp -d /tmp/devbench-stage.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST"
rm -f "$DEST"/*

k8s=$(bash hack/build-k8s.sh | tail -1)
key=$(echo "${BINARIES[*]} ${XZ[*]}" | sha256sum | cut -c1-8)
cache="$(dirname "$(dirname "$k8s")")/device-bench/$(basename "$k8s")-$key.tar.xz"
if ! [ -f "$cache" ]; then
  echo "==> [device-bench] compressing ${BINARIES[*]} (xz ${XZ[*]}: about 10 minutes, once)"
  mkdir -p "$(dirname "$cache")"
  tar -C "$(dirname "$k8s")" -cf - "${BINARIES[@]/#/$(basename "$k8s")/}" \
    | nice -n 10 xz -T1 "${XZ[@]}" > "$work/bin.tar.xz"
  mv "$work/bin.tar.xz" "$cache"
fi
ln -f "$cache" "$DEST/bin.tar.xz" 2>/dev/null || cp "$cache" "$DEST/bin.tar.xz"
basename "$k8s" > "$DEST/bin-dir"

echo "==> [device-bench] Python dependencies for CPython $PY_VERSION (manylinux x86_64)"
"$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
  | grep -Evi "$SKIP" > "$work/requirements.txt"
"$PY" -m pip freeze --exclude-editable > "$work/constraints.txt"
abi="cp${PY_VERSION/./}"
"$PY" -m pip install -q --target "$work/site" --only-binary=:all: --no-compile \
  --python-version "$PY_VERSION" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  --platform any -r "$work/requirements.txt" -c "$work/constraints.txt"
rm -rf "$work"/site/bin
# the Kubernetes client's asyncio twin (42 MB unpacked): nothing in Carpool imports it
if git grep -q -E '(kubernetes\.aio|from kubernetes import aio)' -- '*.py'; then
  echo "error: Carpool imports kubernetes.aio; stop dropping it here" >&2; exit 1
fi
rm -rf "$work"/site/kubernetes/aio
# wheels' extensions keep their debug sections (aiohttp's HTTP parser: 3.3 MB, 0.6 stripped)
find "$work/site" -name '*.so' -exec strip --strip-unneeded {} +
tar -C "$work" -cf - site | xz -T2 -9 > "$DEST/site.tar.xz"
echo "$PY_VERSION" > "$DEST/python-version"
(cd "$DEST" && sha256sum bin.tar.xz site.tar.xz > SHA256SUMS)
ls -la "$DEST"
# A device call carries the tree (tracked and untracked files git does not ignore) and DEST:
# 64 MiB in all.
staged=$(du -sbL "$DEST" | cut -f1)
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
echo "==> [device-bench] $DEST: $(mib "$staged"); with the tree ($(mib "$tree")) a call carries $(mib $((staged + tree))) of 64"
if [ $((staged + tree)) -gt $((64 << 20)) ]; then echo "error: over the device call's 64 MiB" >&2; exit 1; fi
