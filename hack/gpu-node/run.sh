#!/usr/bin/env bash
# `make gpu-node`: Carpool on this machine's GPUs as a real node, everything through pods
# (bench/gpu_node.py says what it measures). On a machine prepared by hack/gpu-node/stage.sh's
# parts (STAGED, default .gpunode) it unpacks them first and runs the staged tree with the
# machine's own python3 (it has PyTorch); elsewhere it runs this checkout with its .venv
# (`GPU_NODE_ARGS=--fake` on a machine without GPUs). Arguments go to bench/gpu_node.py.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$here/bin.sha256" ]; then cd "$here/.."; else cd "$here/../.."; fi
STAGED="${STAGED:-.gpunode}"
export PYTHONUNBUFFERED=1
if [ -f "$STAGED/bin.sha256" ]; then
  start=$(date +%s)
  src=$(bash "$STAGED/unpack.sh" "$STAGED" | tail -1)
  echo "==> [gpu-node] unpacked the staged binaries and tree in $(( $(date +%s) - start ))s"
  dir=$(dirname "$src")
  export CARPOOL_CACHE="$dir/cache"
  bin=$(ls -d "$CARPOOL_CACHE"/bin/k8s-*)
  export CARPOOL_BIN_DIR="$bin" PATH="$bin:$PATH"
  mkdir -p "$dir/pythonpath" && ln -sfn "$src/testbed" "$dir/pythonpath/carpool_testbed"
  export PYTHONPATH="$src/src:$dir/pythonpath"
  cd "$src"
  exec python3 bench/gpu_node.py "$@"
fi
exec .venv/bin/python bench/gpu_node.py "$@"
