#!/bin/sh
# Runs the MPS control daemon in the foreground and shuts it down cleanly on SIGTERM, so that a
# DaemonSet rollout stops the MPS server instead of leaving clients on a dead pipe.
# nvidia-cuda-mps-control belongs to the host's driver: the NVIDIA container toolkit mounts it
# (NVIDIA_DRIVER_CAPABILITIES=compute). CARPOOL_MPS_BACKEND=fake (the chart sets it with
# devicePlugin.backend=fake, for nodes without GPUs) keeps the pipe directories the device
# plugin hands out and runs no daemon: there is no driver to serve.
# CARPOOL_MPS_EXCLUSIVE_PROCESS=1 first sets the GPUs' compute mode to EXCLUSIVE_PROCESS (needs
# a privileged container), which keeps non-MPS processes off MPS GPUs.
set -eu
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ "${CARPOOL_MPS_BACKEND:-nvml}" = "fake" ]; then
  echo "fake GPU backend: no MPS daemon; pipe directory $CUDA_MPS_PIPE_DIRECTORY kept"
  trap 'exit 0' TERM INT
  while :; do sleep 3600 & wait $! || true; done
fi
if ! command -v nvidia-cuda-mps-control >/dev/null; then
  echo "nvidia-cuda-mps-control is not mounted: run this pod with the NVIDIA container" \
       "runtime (devicePlugin.runtimeClassName) on a node with the NVIDIA driver" >&2
  exit 1
fi
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
