#!/usr/bin/env bash
# Builds containerd (with its runc shim and ctr) from the Go module proxy, once per machine, into
# a cache outside the repo keyed by version; prints the bin directory last.
# Why not Debian's: bookworm ships containerd 1.6, whose CRI plugin cannot apply CDI devices;
# the device plugin hands GPUs to containers as CDI devices (1.7 added `enable_cdi`). runc stays
# Debian's (it needs cgo and libseccomp); containerd builds without cgo (no btrfs snapshotter).
set -euo pipefail

CONTAINERD_VERSION="${CONTAINERD_VERSION:-v1.7.35}"
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
BIN="$CACHE/bin/containerd-$CONTAINERD_VERSION"
CMDS=(containerd containerd-shim-runc-v2 ctr)
export CGO_ENABLED=0 GOFLAGS=-trimpath

missing() { for c in "${CMDS[@]}"; do [ -x "$BIN/$c" ] || return 0; done; return 1; }
if ! missing; then echo "==> [build] containerd $CONTAINERD_VERSION cached"; echo "$BIN"; exit 0; fi
mkdir -p "$BIN"
exec 9>"$BIN.lock"
if ! flock -n 9; then
  echo "==> [build] another build of containerd $CONTAINERD_VERSION is running; waiting for it"
  flock 9
fi
if missing; then
  start=$(date +%s)
  echo "==> [build] containerd $CONTAINERD_VERSION (${CMDS[*]}), niced"
  # Built inside the module itself: its go.mod has exclude directives, so `go install pkg@v`
  # is refused; the downloaded module (read-only in the module cache) is a complete main module.
  src=$(go mod download -json "github.com/containerd/containerd@$CONTAINERD_VERSION" \
        | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  ldflags="-s -w -X github.com/containerd/containerd/version.Version=$CONTAINERD_VERSION"
  for c in "${CMDS[@]}"; do
    [ -x "$BIN/$c" ] && continue
    t=$(date +%s)
    (cd "$src" && nice -n 19 go build -mod=readonly -tags "no_btrfs no_devmapper no_zfs no_aufs" \
       -ldflags "$ldflags" -o "$BIN/$c.tmp" "./cmd/$c") && mv "$BIN/$c.tmp" "$BIN/$c"
    echo "    $c in $(( $(date +%s) - t ))s"
  done
  echo "    done in $(( $(date +%s) - start ))s"
fi
echo "$BIN"
