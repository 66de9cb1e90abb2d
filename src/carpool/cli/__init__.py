"""The command-line tools: the kubectl plugin `kubectl-carpool` and `carpool` (offline
replays, no cluster)."""
