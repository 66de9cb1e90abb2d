#!/bin/sh
# Runs the MPS control daemon in the foreground, fences every client at the node's ceiling, and
# shuts it down cleanly on SIGTERM, so that a DaemonSet rollout stops the MPS server instead of
# leaving clients on a dead pipe.
# nvidia-cuda-mps-control belongs to the host's driver: the NVIDIA container toolkit mounts it
# (NVIDIA_DRIVER_CAPABILITIES=compute). CARPOOL_MPS_BACKEND=fake (the chart sets it with
# devicePlugin.backend=fake, for nodes without GPUs) keeps the pipe directories the device
# plugin hands out and runs no daemon: there is no driver to serve.
#
# The fence: right after the daemon answers, and before any client can start an MPS server, each
# GPU gets the daemon defaults `set_default_device_pinned_mem_limit <uuid> <ceiling>` and
# `set_default_active_thread_percentage <ceiling>` (CARPOOL_MPS_CEILING_PERCENT of the GPU).
# A client may lower its limits below them, never raise them; defaults set after a server
# started would not reach it. The device plugin checks the defaults before it serves MPS pods.
#
# The compute mode (EXCLUSIVE_PROCESS, which keeps processes that skip MPS off the GPU) is set
# by the chart's privileged init container (`nvidia-smi -c EXCLUSIVE_PROCESS`), not here.
set -eu
ceiling="${CARPOOL_MPS_CEILING_PERCENT:-50}"
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
stop() {
  echo "stopping the MPS control daemon"
  echo quit | nvidia-cuda-mps-control || true
}
trap stop TERM INT
echo "MPS control daemon: pipes in $CUDA_MPS_PIPE_DIRECTORY, logs in $CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -f &
daemon=$!
tries=0
until echo get_server_list | nvidia-cuda-mps-control >/dev/null 2>&1; do
  tries=$((tries + 1))
  if [ "$tries" -gt 100 ]; then echo "the MPS control daemon did not answer" >&2; exit 1; fi
  sleep 0.1
done
echo "set_default_active_thread_percentage $ceiling" | nvidia-cuda-mps-control
nvidia-smi --query-gpu=uuid,memory.total --format=csv,noheader,nounits |
  while IFS=', ' read -r uuid total; do
    gib=$((total * ceiling / 100 / 1024))  # whole GiB, as carpool.core.resources.mps_ceiling_mib
    echo "set_default_device_pinned_mem_limit $uuid ${gib}G" | nvidia-cuda-mps-control
    echo "GPU $uuid: each MPS client held to $gib GiB and $ceiling % of the SMs"
  done
# wait returns early when a trapped signal arrives; wait again for the daemon to exit.
wait "$daemon" || true
wait "$daemon" 2>/dev/null || true
