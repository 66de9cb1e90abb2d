#!/bin/sh
# Runs the MPS control daemon in the foreground and shuts it down cleanly on SIGTERM, so that a
# DaemonSet rollout stops the MPS server instead of leaving clients on a dead pipe.
# CARPOOL_MPS_EXCLUSIVE_PROCESS=1 first sets the GPUs' compute mode to EXCLUSIVE_PROCESS (needs
# a privileged container), which keeps non-MPS processes off MPS GPUs.
set -eu
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ "${CARPOOL_MPS_EXCLUSIVE_PROCESS:-0}" = "1" ]; then
  nvidia-smi -c EXCLUSIVE_PROCESS
fi
stop() {
  echo "stopping the MPS control daemon"
  echo quit | nvidia-cuda-mps-control || true
}
trap stop TERM INT
echo "MPS control daemon: pipes in $CUDA_MPS_PIPE_DIRECTORY, logs in $CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -f &
daemon=$!
# wait returns early when a trapped signal arrives; wait again for the daemon to exit.
wait "$daemon" || true
wait "$daemon" 2>/dev/null || true
