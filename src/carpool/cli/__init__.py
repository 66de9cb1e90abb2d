"""Command-line tools: `carpool` and the kubectl plugin `kubectl-carpool`."""
