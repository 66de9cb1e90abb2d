"""Where the openb trace files are: the repo's `traces/openb/` (see its README), or the folder
$CARPOOL_TRACES names."""

from __future__ import annotations

import os
from pathlib import Path

OPENB = Path(__file__).resolve().parents[1] / "traces" / "openb"
NODE_LIST = "openb_node_list_gpu_node.csv"
DEFAULT_PODS = "openb_pod_list_default.csv"


def traces_dir() -> Path:
    """$CARPOOL_TRACES if set, else the copy in the repo."""
    env = os.environ.get("CARPOOL_TRACES")
    return Path(env) if env else OPENB


def node_list() -> Path:
    """The openb GPU node list (1,213 nodes)."""
    return traces_dir() / NODE_LIST


def pod_list(trace: str = "default") -> Path:
    """One openb pod list: `default`, `gpushare40`, `multigpu20` or `gpuspec10`."""
    return traces_dir() / f"openb_pod_list_{trace}.csv"
