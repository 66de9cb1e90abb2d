#!/usr/bin/env bash
# Stages everything `make gpu-node` needs on a GPU machine that has no network and none of the
# node's programs: the Kubernetes, etcd, KWOK and Helm binaries (hack/build-k8s.sh), the
# registry and crane (hack/build-registry.sh), containerd with CDI support
# (hack/build-containerd.sh), the NVIDIA container runtime, Debian's runc, CNI plugins and
# static busybox, the images
# carpool, carpool-mps and kube-scheduler (hack/images/build.py), and this commit's tree.
# Binaries are stripped by their builds and compressed with xz; the result is split into parts
# of PART_MIB MiB (default 55) in DEST (default .gpunode), so each part travels on its own, and
# each part is also linked into a folder of its own beside DEST (DEST-0/, DEST-1/, ...): one
# transfer to the GPU machine carries one such folder (and moves its part out of the checkout
# there, to $GPU_NODE_PARTS) where a transferred path replaces its whole folder.
# CARPOOL_GPU_NODE_IMAGES=reuse keeps build/images, CARPOOL_GPU_NODE_BIN=reuse the binary parts.
# On the GPU machine hack/gpu-node/unpack.sh puts them together again.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST="${1:-.gpunode}"
PART_MIB="${PART_MIB:-55}"
PY="${PY:-.venv/bin/python}"
work=$(mktemp -d /tmp/gpunode-stage.XXXXXX)
trap 'rm -rf "$work"' EXIT
root="$work/root"
mkdir -p "$root/cache/bin" "$root/usr/local/bin" "$root/usr/lib/cni" "$root/usr/bin" "$DEST"

echo "==> [stage] binaries"
k8s=$(bash hack/build-k8s.sh | tail -1)
registry=$(bash hack/build-registry.sh | tail -1)
containerd=$(bash hack/build-containerd.sh | tail -1)
# The NVIDIA container runtime (CDI mode) for the plugin's and the MPS daemon's RuntimeClass:
# a Go build, once per cache.
NCT_VERSION="${NCT_VERSION:-v1.17.8}"
nct="${CARPOOL_CACHE:-$HOME/.cache/carpool}/bin/nvidia-container-toolkit-$NCT_VERSION"
if ! [ -x "$nct/nvidia-container-runtime" ]; then
  GOBIN="$nct" CGO_ENABLED=1 GOFLAGS=-trimpath nice -n 19 go install -ldflags "-s -w" \
    "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-container-runtime@$NCT_VERSION"
fi
cp -a "$k8s" "$registry" "$containerd" "$root/cache/bin/"
cp -a "$nct/nvidia-container-runtime" "$root/usr/local/bin/"

echo "==> [stage] Debian's runc, CNI plugins and static busybox"
debs="$work/debs"; mkdir -p "$debs"
(cd "$debs" && apt-get download -q runc containernetworking-plugins busybox-static >/dev/null)
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$debs/x"; done
cp -a "$debs/x/usr/sbin/runc" "$root/usr/local/bin/"
cp -a "$debs"/x/usr/lib/cni/{bridge,host-local,loopback} "$root/usr/lib/cni/"
cp -a "$debs/x/bin/busybox" "$root/usr/bin/busybox"

echo "==> [stage] images (build/images)"
if [ "${CARPOOL_GPU_NODE_IMAGES:-build}" != reuse ] || ! [ -f build/images/kube-scheduler/index.json ]; then
  "$PY" hack/images/build.py --out build/images --with-scheduler "$k8s/kube-scheduler"
fi

echo "==> [stage] compress (xz) and split into $PART_MIB MiB parts"
start=$(date +%s)
# Three payloads, so a change of code re-sends only what changed: the binaries (bin.*), the
# images (img.*, rebuilt with the code they package) and this commit's tree (src.tar.gz).
if [ "${CARPOOL_GPU_NODE_BIN:-build}" != reuse ] || ! [ -f "$DEST/bin.sha256" ]; then
  rm -f "$DEST"/bin.*
  tar -C "$root" -cf - . | xz -T2 -6 --lzma2=preset=6,dict=192MiB | split -b "${PART_MIB}M" -d -a 2 - "$DEST/bin."
  cat "$DEST"/bin.[0-9]* | sha256sum | cut -d' ' -f1 > "$DEST/bin.sha256"
  echo "    binaries: $(cat "$DEST"/bin.[0-9]* | wc -c | awk '{printf "%.1f", $1/1048576}') MiB in $(( $(date +%s) - start ))s"
fi
rm -f "$DEST"/img.*
tar -C build -cf - images | split -b "${PART_MIB}M" -d -a 2 - "$DEST/img."
cat "$DEST"/img.[0-9]* | sha256sum | cut -d' ' -f1 > "$DEST/img.sha256"
git archive --format=tar.gz --prefix=src/ HEAD > "$DEST/src.tar.gz"
cp hack/gpu-node/unpack.sh hack/gpu-node/run.sh "$DEST/"
rm -rf "$DEST"-[0-9]*
i=0
for part in "$DEST"/bin.[0-9]* "$DEST"/img.[0-9]*; do
  mkdir -p "$DEST-$i" && ln -f "$part" "$DEST-$i/"; i=$((i + 1))
done
ls -la "$DEST" "$DEST"-[0-9]*
