#!/usr/bin/env bash
# On the GPU machine: puts the parts hack/gpu-node/stage.sh made back together and installs
# them: containerd, runc and the CNI plugins on the system paths the real node uses, static
# busybox (only where no static one is), the cached binaries under CARPOOL_CACHE, and the
# staged tree in DIR/src. Prints the source directory last. Idempotent.
set -euo pipefail
STAGED="${1:-.gpunode}"
DIR="${GPU_NODE_DIR:-/var/tmp/carpool-gpu-node}"
CACHE="${CARPOOL_CACHE:-$DIR/cache}"
want=$(cat "$STAGED/payload.sha256")
if [ "$(cat "$DIR/unpacked.sha256" 2>/dev/null)" != "$want" ]; then
  have=$(cat "$STAGED"/part.* | sha256sum | cut -d' ' -f1)
  if [ "$have" != "$want" ]; then
    echo "error: the parts in $STAGED ($(ls "$STAGED" | tr '\n' ' ')) do not add up to the payload" >&2
    exit 1
  fi
  rm -rf "$DIR"; mkdir -p "$DIR/root" "$CACHE"
  cat "$STAGED"/part.* | tar -C "$DIR" -xf -
  python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 24)' \
    "$DIR/bin.tar.xz" | tar -C "$DIR/root" -xf -
  rm -f "$DIR/bin.tar.xz"
  tar -C "$DIR" -xf "$DIR/src.tar" && rm -f "$DIR/src.tar"
  cp -a "$DIR"/root/cache/bin "$CACHE/"
  cp -a "$DIR"/root/usr/local/bin/* /usr/local/bin/
  mkdir -p /usr/lib/cni && cp -a "$DIR"/root/usr/lib/cni/* /usr/lib/cni/
  echo "$want" > "$DIR/unpacked.sha256"
fi
# The pause and test images' payload must be a static busybox; busybox also stands in for
# `ip` where the machine has none.
if ! [ -x /bin/busybox ] || ldd /bin/busybox >/dev/null 2>&1; then
  cp "$DIR/root/usr/bin/busybox" /bin/busybox
fi
command -v ip >/dev/null || ln -sf /bin/busybox /usr/local/bin/ip
command -v brctl >/dev/null || ln -sf /bin/busybox /usr/local/bin/brctl
echo "$DIR/src"
