#!/usr/bin/env bash
# On an offline GPU machine (16 cores, no network): `bench/extender.py --cluster --null-extender`
# (pods/s through a private kube-scheduler with no extender, a null one and Carpool's; see
# docs/benchmarks.md), run from this tree with the folder hack/device-bench/stage.sh made
# (STAGED, default .devbench). It unpacks the binaries and Python packages into DEVBENCH_DIR
# (default /tmp/carpool-devbench), installs this tree's Carpool there (the test bed runs in
# place), starts the cluster (CARPOOL_CLUSTER, default devbench) and runs one bench per
# NODES:PODS in DEVBENCH_RUNS (default "5000:2000 1000:1000"), under `chrt -r 10` where the
# machine allows it (the cluster's processes, started beneath, inherit it). A run is cut where
# it would pass DEVBENCH_DEADLINE_S seconds since the start (default 540, inside the device
# call's 600), a later one skipped. Logs, the components' logs (logs.tar.xz) and the table
# (summary.md, hack/device-bench/summary.py) go to OUT (the device call's $OUT).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/../.."
STAGED="${STAGED:-.devbench}"
DIR="${DEVBENCH_DIR:-/tmp/carpool-devbench}"
OUT="${OUT:-$DIR/out}"
RUNS="${DEVBENCH_RUNS:-5000:2000 1000:1000}"
DEADLINE_S="${DEVBENCH_DEADLINE_S:-540}"
export PYTHONUNBUFFERED=1
say() { echo "==> [device-bench $(( $(date +%s) - start ))s] $*"; }
die() { echo "error: $*" >&2; exit 1; }
mkdir -p "$DIR" "$OUT"
{ nproc; uname -a; python3 --version; } > "$OUT/machine.txt" 2>&1

staged_py=$(cat "$STAGED/python-version") || die "no $STAGED/python-version: run hack/device-bench/stage.sh"
have_py=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$staged_py" = "$have_py" ] || die "$STAGED holds packages for Python $staged_py; python3 is $have_py"
(cd "$STAGED" && sha256sum -c --quiet SHA256SUMS) || die "$STAGED does not match its SHA256SUMS"
rm -rf "$DIR/bin" "$DIR/site" "$DIR/carpool" "$DIR/tmp"
mkdir -p "$DIR/bin" "$DIR/tmp"
unxz() {  # ARCHIVE DIR: python3's lzma, since the machine may lack xz
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 24)' \
    "$1" | tar -C "$2" -xf - || die "unpacking $1 failed"
}
unxz "$STAGED/bin.tar.xz" "$DIR/bin"
unxz "$STAGED/site.tar.xz" "$DIR"
say "unpacked the binaries and packages"
export PYTHONPATH="$DIR/site"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --disable-pip-version-check --target "$DIR/carpool" . > "$DIR/pip.log" 2>&1 \
  || { cat "$DIR/pip.log"; die "installing Carpool from this tree failed"; }
# the test bed runs from the checkout (it reads crds/, traces/ and hack/ beside it), as with
# the editable install: a link, which its modules resolve back to the tree
ln -sfn "$PWD/testbed" "$DIR/carpool/carpool_testbed"
export PYTHONPATH="$DIR/carpool:$DIR/site"
bin="$DIR/bin/$(cat "$STAGED/bin-dir")"
export CARPOOL_CACHE="${CARPOOL_CACHE:-$DIR/cache}" CARPOOL_BIN_DIR="$bin" PATH="$bin:$PATH"
export CARPOOL_CLUSTER="${CARPOOL_CLUSTER:-devbench}" TMPDIR="$DIR/tmp"
say "installed Carpool from this tree ($(git rev-parse --short HEAD 2>/dev/null || echo '?'))"

rt=()
if chrt -r 10 true 2>/dev/null; then rt=(chrt -r 10); fi
say "real-time priority: ${rt[*]:-not available}" | tee -a "$OUT/machine.txt"
"${rt[@]}" python3 -m carpool_testbed.devcluster up > "$OUT/cluster-up.log" 2>&1 \
  || { tail -30 "$OUT/cluster-up.log"; die "the cluster did not start"; }
say "cluster $CARPOOL_CLUSTER up"

logs=()
for run in $RUNS; do
  nodes=${run%%:*} pods=${run##*:}
  left=$(( DEADLINE_S - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then say "skipped $nodes nodes, $pods pods: ${left}s left"; continue; fi
  say "$nodes nodes, $pods pods (at most ${left}s)"
  # SIGINT: the bench's cleanup stops the extenders and schedulers it started
  logs+=("$OUT/extender-$nodes-$pods.log")
  timeout -s INT -k 20 "$left" "${rt[@]}" python3 bench/extender.py --cluster \
    --nodes "$nodes" --pods "$pods" --null-extender 2>&1 | tee "${logs[-1]}"
  say "$nodes nodes, $pods pods: exit ${PIPESTATUS[0]}"
done

# each bench's workdir (its schedulers' and extenders' logs) and the cluster's component logs
python3 - "$OUT/logs.tar.xz" "$TMPDIR"/*/*.log "$CARPOOL_CACHE/clusters/$CARPOOL_CLUSTER"/logs/*.log <<'PY'
import sys
import tarfile
from pathlib import Path

with tarfile.open(sys.argv[1], "w:xz", preset=3) as tar:
    for path in map(Path, sys.argv[2:]):
        if path.is_file():
            tar.add(path, arcname=f"{path.parent.name}/{path.name}")
PY
# the device call brings back files of at most 16 MiB
if [ "$(stat -c %s "$OUT/logs.tar.xz")" -gt 16000000 ]; then
  mv "$OUT/logs.tar.xz" "$DIR/"; say "logs.tar.xz too large to come back; left in $DIR"
fi
python3 -m carpool_testbed.devcluster down > "$DIR/cluster-down.log" 2>&1
python3 hack/device-bench/summary.py "${logs[@]}" | tee "$OUT/summary.md"
say "done"
