# The CUDA MPS control daemon for nodes labelled carpool.dev/sharing=mps.
# Build:  docker build -f docker/mps.Dockerfile -t carpool-mps:0.1.0 docker
# nvidia-cuda-mps-control and nvidia-cuda-mps-server belong to the host's driver; the NVIDIA
# container runtime mounts them (NVIDIA_DRIVER_CAPABILITIES=compute,utility), so the image
# carries only the start-up script. Use a CUDA base no newer than the nodes' driver supports.
ARG CUDA_VERSION=12.8.1
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu24.04
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_MPS_PIPE_DIRECTORY=/run/carpool/mps/pipe \
    CUDA_MPS_LOG_DIRECTORY=/run/carpool/mps/log
COPY mps-entrypoint.sh /usr/local/bin/mps-entrypoint.sh
ENTRYPOINT ["/usr/local/bin/mps-entrypoint.sh"]
