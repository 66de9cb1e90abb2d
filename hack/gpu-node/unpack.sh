#!/usr/bin/env bash
# On the GPU machine: puts the parts hack/gpu-node/stage.sh made back together and installs
# them: containerd, runc, the NVIDIA runtime and the CNI plugins on the system paths the real
# node uses, static busybox (only where no static one is), the cached binaries under
# CARPOOL_CACHE, the images in DIR/src/build/images and the staged tree in DIR/src. Prints the
# source directory last. A payload already unpacked (same checksum) is skipped. The parts may
# lie in STAGED or in GPU_NODE_PARTS (where each call moved the part it carried).
set -euo pipefail
STAGED="${1:-.gpunode}"
PARTS="${GPU_NODE_PARTS:-/var/tmp/carpool-gpu-node-parts}"
for part in "$PARTS"/*.[0-9][0-9]; do [ -e "$part" ] && ln -sf "$part" "$STAGED/"; done
DIR="${GPU_NODE_DIR:-/var/tmp/carpool-gpu-node}"
CACHE="${CARPOOL_CACHE:-$DIR/cache}"
mkdir -p "$DIR" "$CACHE"

joined() {  # NAME: the parts of payload NAME, checked against NAME.sha256, on stdout
  local want have
  want=$(cat "$STAGED/$1.sha256")
  have=$(cat "$STAGED/$1".[0-9]* | sha256sum | cut -d' ' -f1)
  if [ "$have" != "$want" ]; then
    echo "error: the parts $(cd "$STAGED" && ls "$1".[0-9]* | tr '\n' ' ')do not add up to $1" >&2
    return 1
  fi
  cat "$STAGED/$1".[0-9]*
}
fresh() {  # NAME: whether payload NAME differs from the one unpacked last
  [ "$(cat "$DIR/$1.unpacked" 2>/dev/null)" != "$(cat "$STAGED/$1.sha256")" ]
}

if fresh bin; then
  rm -rf "$DIR/root"; mkdir -p "$DIR/root"
  joined bin | python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 24)' \
    | tar -C "$DIR/root" -xf -
  cp -a "$DIR"/root/cache/bin "$CACHE/"
  cp -a "$DIR"/root/usr/local/bin/* /usr/local/bin/
  mkdir -p /usr/lib/cni && cp -a "$DIR"/root/usr/lib/cni/* /usr/lib/cni/
  cp "$STAGED/bin.sha256" "$DIR/bin.unpacked"
fi
rm -rf "$DIR/src"; mkdir -p "$DIR/src"
tar -C "$DIR" -xzf "$STAGED/src.tar.gz"
if fresh img || ! [ -d "$DIR/images" ]; then
  rm -rf "$DIR/images"; joined img | tar -C "$DIR" -xf -
  cp "$STAGED/img.sha256" "$DIR/img.unpacked"
fi
mkdir -p "$DIR/src/build" && ln -sfn "$DIR/images" "$DIR/src/build/images"
# The pause and test images' payload must be a static busybox; busybox also stands in for
# `ip` and `brctl` where the machine has none.
if ! [ -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then
  cp "$DIR/root/usr/bin/busybox" /bin/busybox
fi
command -v ip >/dev/null || ln -sf /bin/busybox /usr/local/bin/ip
command -v brctl >/dev/null || ln -sf /bin/busybox /usr/local/bin/brctl
# hack/images/registry.sh probes the registry with `curl -fsS -o /dev/null URL`.
if ! command -v curl >/dev/null; then
  printf '%s\n' '#!/bin/sh' 'for url; do :; done' \
    'exec python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$url" 2>/dev/null' \
    > /usr/local/bin/curl
  chmod +x /usr/local/bin/curl
fi
echo "$DIR/src"
