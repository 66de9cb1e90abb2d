#!/usr/bin/env bash
# Builds Kueue's manager from the Go module proxy, once per machine, into the same cache as
# hack/build-k8s.sh, and copies its CRDs and webhook configuration beside the binary (they come
# from the module's own config/ tree, so the manager and its API match exactly).
# Used only by bench/peers.py (the side-by-side benchmark), never by the product.
set -euo pipefail

KUEUE_VERSION="${KUEUE_VERSION:-v0.17.0}"
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
OUT="$CACHE/bin/kueue-$KUEUE_VERSION"
export GOFLAGS=-mod=mod CGO_ENABLED=0

if [ -x "$OUT/kueue" ] && [ -d "$OUT/config" ]; then
  echo "$OUT"; exit 0
fi
mkdir -p "$OUT" "$CACHE/src"
start=$(date +%s)
echo "==> [build] kueue $KUEUE_VERSION: downloading the module" >&2
dir=$(cd "$CACHE/src" && go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
echo "==> [build] kueue $KUEUE_VERSION: compiling the manager (nice 19)" >&2
GOBIN="$OUT/.gobin" nice -n 19 go install -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
  "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" >&2
mv "$OUT/.gobin/kueue" "$OUT/kueue.tmp" && rmdir "$OUT/.gobin"
rm -rf "$OUT/config.tmp" && mkdir -p "$OUT/config.tmp"
cp "$dir"/config/components/crd/bases/*.yaml "$OUT/config.tmp/"
cp "$dir"/config/components/webhook/manifests.yaml "$OUT/config.tmp/webhook-manifests.yaml"
chmod -R u+w "$OUT/config.tmp"
rm -rf "$OUT/config" && mv "$OUT/config.tmp" "$OUT/config"
mv "$OUT/kueue.tmp" "$OUT/kueue"
echo "    done in $(( $(date +%s) - start ))s" >&2
echo "$OUT"
