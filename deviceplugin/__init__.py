"""The Carpool kubelet device plugin: fractional GPUs over MPS/MIG, health and telemetry."""
