#!/usr/bin/env bash
# Runs a command and prints how long it took, so CI logs show each stage's time.
name="$1"; shift
start=$(date +%s)
echo "==> [$name] $*"
"$@"; rc=$?
echo "==> [$name] finished in $(( $(date +%s) - start ))s (exit $rc)"
exit $rc
