"""Generated gRPC stubs for the kubelet device plugin API v1beta1 (`make proto` regenerates)."""
