"""Hardware access behind one Protocol: NVML for real GPUs, a fake for tests and simulated nodes."""
