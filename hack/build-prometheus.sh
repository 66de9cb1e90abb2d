#!/usr/bin/env bash
# Builds Prometheus from the Go module proxy, once per machine, into a cache outside the repo
# keyed by version; prints the bin directory last. Only static scrape configs are needed, so
# every service discovery is left out (`remove_all_sd`), which keeps the build small. Niced:
# it is heavy on a small machine. One build at a time per cache (the cache's build lock).
set -euo pipefail

PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
BIN="$CACHE/bin/prometheus-$PROMETHEUS_VERSION"
export CGO_ENABLED=0 GOFLAGS=-trimpath

if [ ! -x "$BIN/prometheus" ]; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/prometheus.lock"
  flock 9
fi
if [ ! -x "$BIN/prometheus" ]; then
  start=$(date +%s)
  echo "==> [build] prometheus (github.com/prometheus/prometheus@$PROMETHEUS_VERSION), niced"
  mkdir -p "$BIN"
  GOBIN="$BIN" nice -n 19 go install -tags remove_all_sd -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  echo "    done in $(( $(date +%s) - start ))s"
fi
echo "$BIN"
