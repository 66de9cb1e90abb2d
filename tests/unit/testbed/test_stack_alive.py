"""`stack.check_alive`: a run stops, naming the component and its log, once one has exited."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from carpool_testbed import stack


def test_a_component_that_exited_stops_the_run_with_its_log(tmp_path: Path) -> None:
    (tmp_path / "operator.log").write_text("starting\nImportError: no module named x\n")
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait(timeout=30)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stack.check_alive({"extender": running}, tmp_path)  # alive: nothing to say
        with pytest.raises(RuntimeError, match=r"the operator exited \(3\)") as raised:
            stack.check_alive({"extender": running, "operator": gone}, tmp_path)
        assert "ImportError: no module named x" in str(raised.value)
    finally:
        running.kill()
        running.wait(timeout=30)
