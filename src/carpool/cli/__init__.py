"""The command-line tool: the kubectl plugin `kubectl-carpool`."""
