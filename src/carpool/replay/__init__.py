"""Replays of traces through the core's rules, for `carpool simulate` and the benchmarks.

Research code, not rules the operator runs: the placement replay of the openb traces against
peer policies (`simulation`, `peers`), the queue replay of generated and recorded traces
(`queue_replay`, `job_traces`, `progress_traces`). It imports the core, never the reverse.
"""
