#!/bin/sh
# Readiness of the MPS daemon pod: the control daemon answers on its pipe (with the fake
# backend: the pipe directory the device plugin hands to clients exists).
set -eu
if [ "${CARPOOL_MPS_BACKEND:-nvml}" = "fake" ]; then
  test -d "$CUDA_MPS_PIPE_DIRECTORY"
else
  echo get_server_list | nvidia-cuda-mps-control >/dev/null
fi
