"""The kube-scheduler extender: HTTP filter, prioritize and bind over the placement core."""
