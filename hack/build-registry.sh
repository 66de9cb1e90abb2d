#!/usr/bin/env bash
# Builds the CNCF distribution registry and crane (a registry client) from the Go module proxy,
# once per machine, into a cache outside the repo keyed by version; prints the bin directory last.
# Both are plain `go install`s: neither module replaces its dependencies with local paths.
set -euo pipefail

REGISTRY_VERSION="${REGISTRY_VERSION:-v3.1.2}"
CRANE_VERSION="${CRANE_VERSION:-v0.22.1}"
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
BIN="$CACHE/bin/registry-$REGISTRY_VERSION-crane-$CRANE_VERSION"
export CGO_ENABLED=0 GOFLAGS=-trimpath

build() {  # NAME PACKAGE@VERSION
  [ -x "$BIN/$1" ] && return 0
  local start; start=$(date +%s)
  echo "==> [build] $1 ($2), niced"
  mkdir -p "$BIN"
  GOBIN="$BIN" nice -n 19 go install -ldflags "-s -w" "$2"
  echo "    done in $(( $(date +%s) - start ))s"
}

build registry "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION"
build crane "github.com/google/go-containerregistry/cmd/crane@$CRANE_VERSION"
echo "$BIN"
