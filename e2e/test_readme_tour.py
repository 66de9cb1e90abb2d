"""The README's tour, as written, after `make demo`.

Runs the demo on a cluster of its own, then every command block of the README's tour section
and the `kubectl carpool` commands its steps name, in order, a few seconds apart as a reader
would type them, and checks what each step says it shows. A tour step that stops working, or
a README edit that breaks a command, fails here. The cluster is removed at the end
(CARPOOL_KEEP_CLUSTER=1 keeps it, with the demo's operator and extender).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOUR_CLUSTER = "carpool-tour"
TOUR_EXTENDER_PORT = "18097"
PAUSE_S = 5  # between steps, as a reader would take


def tour_steps(readme: str) -> list[str]:
    """The tour's shell blocks, then the `kubectl carpool` commands its later steps name."""
    start = readme.index("## A tour after `make demo`")
    end = readme.index("\n## ", start + 1) if "\n## " in readme[start + 1:] else len(readme)
    tour = readme[start:end]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```sh\n(.*?)```", tour, re.S)]
    named = re.findall(r"`(kubectl carpool (?:why|quota|nodes|report)[^`]*)`", tour)
    return blocks + named


@pytest.fixture(scope="module")
def tour_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    built = subprocess.run(["bash", str(REPO / "hack" / "build-k8s.sh")], capture_output=True,
                           text=True, check=True)
    env = dict(os.environ, CARPOOL_CLUSTER=TOUR_CLUSTER, CARPOOL_EXTENDER_PORT=TOUR_EXTENDER_PORT,
               CARPOOL_BIN_DIR=built.stdout.strip().splitlines()[-1])
    logs = tmp_path_factory.mktemp("demo")
    try:
        demo = subprocess.run([sys.executable, "-m", "carpool_testbed.demo", "--log-dir",
                               str(logs)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900, check=False)
        assert demo.returncode == 0, demo.stdout[-4000:] + demo.stderr[-4000:]
        yield env
    finally:
        if os.environ.get("CARPOOL_KEEP_CLUSTER", "") in ("", "0"):
            for module in ("carpool_testbed.stack", "carpool_testbed.devcluster"):
                subprocess.run([sys.executable, "-m", module, "down"], cwd=REPO, env=env,
                               capture_output=True, check=False)


def run_step(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One step in a shell that has run the tour's first block (KUBECONFIG, PATH)."""
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.timeout(1200)  # its setup runs the whole demo
def test_the_readme_tour_works_after_make_demo(tour_env: dict[str, str]) -> None:
    steps = tour_steps((REPO / "README.md").read_text())
    assert len(steps) >= 8, steps
    setup, *rest = steps
    assert "KUBECONFIG" in setup and "PATH" in setup
    outputs = []
    for step in rest:
        time.sleep(PAUSE_S)
        result = run_step(f"{setup}\n{step}", tour_env)
        refused = "bad-mig" in step
        assert (result.returncode != 0) == refused, (step, result.stdout, result.stderr)
        outputs.append(result.stdout + result.stderr)
    text = "\n".join(outputs)
    # step 1: the demo's objects and its four nodes, the MIG node among them
    assert "pretrain-shard-0" in text and "h200-mig" in text
    # step 2: the three example jobs are created and the refused spec names the field
    assert "gpujob.carpool.dev/notebook-mig created" in text
    assert "spec.gpu.cores: Forbidden" in text
    # steps 3 and 4: the week-long job waits on the budget, with the numbers
    assert re.search(r"vision/week-long\s.*Budget", text)
    assert re.search(r"budget\s+BLOCKING", text)
    # steps 5 to 7: quotas, the MIG notebook on its GPU, the bill
    assert re.search(r"^vision\s+500\s", text, re.M)
    assert "vision/notebook-mig-1(mig)" in text
    assert "TOTAL" in text
