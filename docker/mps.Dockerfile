# The CUDA MPS control daemon's wrapper for nodes labelled carpool.dev/sharing=mps.
# Build:  docker build -f docker/mps.Dockerfile -t carpool-mps:0.1.0 docker
# nvidia-cuda-mps-control and nvidia-cuda-mps-server belong to the host's driver; the NVIDIA
# container toolkit mounts them (NVIDIA_DRIVER_CAPABILITIES=compute,utility), so the image
# carries only a shell and the scripts. hack/images/build.py builds the same without an engine.
FROM debian:bookworm-slim
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CUDA_MPS_PIPE_DIRECTORY=/run/carpool/mps/pipe \
    CUDA_MPS_LOG_DIRECTORY=/run/carpool/mps/log \
    PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/nvidia/bin
COPY mps-entrypoint.sh mps-ready.sh /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/mps-entrypoint.sh"]
