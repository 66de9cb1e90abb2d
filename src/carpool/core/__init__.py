"""The pure core: queueing, quota, preemption, placement, accounting and ETA.

Nothing here talks to a cluster, a GPU, the network or the clock: every function takes what it
needs (snapshots and `now`) as arguments and returns decisions. An import-linter contract keeps
it that way.
"""
