"""Carpool: share GPUs on Kubernetes."""

__version__ = "0.1.0"
