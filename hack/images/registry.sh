#!/usr/bin/env bash
# The local image registry: the CNCF distribution registry (hack/build-registry.sh) on
# 127.0.0.1:$CARPOOL_REGISTRY_PORT (default 5001), storing under $CARPOOL_CACHE/registry.
#   registry.sh up | down | status | address
# Plain HTTP on loopback only: the real node's containerd reaches it through its registry host
# configuration (hosts.toml, see carpool.realnode), nothing else needs to.
set -euo pipefail
CACHE="${CARPOOL_CACHE:-$HOME/.cache/carpool}"
PORT="${CARPOOL_REGISTRY_PORT:-5001}"
DIR="$CACHE/registry"
PIDFILE="$DIR/registry-$PORT.pid"
ADDRESS="localhost:$PORT"

alive() {
  [ -f "$PIDFILE" ] || return 1
  local pid; pid=$(cat "$PIDFILE")
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "registry serve $DIR/config-$PORT.yml"
}
answers() { curl -fsS -o /dev/null "http://127.0.0.1:$PORT/v2/" 2>/dev/null; }

case "${1:-status}" in
  up)
    if alive && answers; then echo "$ADDRESS"; exit 0; fi
    bin=$(bash "$(dirname "$0")/../build-registry.sh" | tail -1)
    mkdir -p "$DIR/data"
    cat > "$DIR/config-$PORT.yml" <<YAML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $DIR/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$PORT
YAML
    # OTEL exporters are on by default in registry v3; nothing here collects traces.
    OTEL_TRACES_EXPORTER=none nohup "$bin/registry" serve "$DIR/config-$PORT.yml" \
      >> "$DIR/registry-$PORT.log" 2>&1 &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 100); do answers && { echo "$ADDRESS"; exit 0; }; sleep 0.1; done
    echo "the registry did not answer on 127.0.0.1:$PORT; log: $DIR/registry-$PORT.log" >&2
    tail -5 "$DIR/registry-$PORT.log" >&2; exit 1 ;;
  down)
    if alive; then kill "$(cat "$PIDFILE")"; echo "registry on $ADDRESS stopped"; fi
    rm -f "$PIDFILE" ;;
  status)
    if alive && answers; then echo "registry serving on $ADDRESS"; else echo "no registry on $ADDRESS"; exit 1; fi ;;
  address) echo "$ADDRESS" ;;
  *) echo "usage: $0 up|down|status|address" >&2; exit 2 ;;
esac
