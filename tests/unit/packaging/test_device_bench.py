"""hack/device-bench/summary.py: the table row read from `bench/extender.py --cluster
--null-extender` output (a real run's lines), and a run cut before Carpool's setup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HEADER_ROWS = 2

RUN = """\
1000 KWOK nodes (8 GPUs each) created in 17s
  bind -> Running (KWOK) median 1361 ms
  API server: 1000 Binding POSTs, mean 1029.1 ms; Carpool extender process CPU 0.1 s
without extender  1000 of 1000 pods bound; 623 pods/s (first to last bind)
  bind -> Running (KWOK) median 1461 ms
  API server: 1000 Binding POSTs, mean 173.0 ms; Carpool extender process CPU 0.2 s
null extender     1000 of 1000 pods bound; 231 pods/s (first to last bind)
  bind -> Running (KWOK) median 1098 ms
  API server: 1000 Binding POSTs, mean 148.6 ms; Carpool extender process CPU 2.3 s
with extender     1000 of 1000 pods bound; 179 pods/s (first to last bind)
  extender filter: 1000 calls, mean 0.6 ms
  extender bind: 1000 calls, mean 214.6 ms
ratio null extender/without: 0.37
ratio with extender/without: 0.29
"""


def summary(tmp_path: Path, logs: dict[str, str]) -> list[str]:
    paths = []
    for name, text in logs.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(text)
    result = subprocess.run([sys.executable, str(REPO / "hack" / "device-bench" / "summary.py"),
                             *map(str, paths)], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()[HEADER_ROWS:]


def test_a_whole_run_gives_the_rates_ratios_filter_mean_and_cpu_per_pod(tmp_path: Path) -> None:
    assert summary(tmp_path, {"extender-1000-1000.log": RUN}) == [
        "| 1,000, 1,000 | 623 pods/s | 231 pods/s | **179 pods/s** | 0.77 | 0.29 | 0.6 ms "
        "| 2.3 ms |"]


def test_a_cut_run_shows_what_finished_in_the_order_given(tmp_path: Path) -> None:
    cut = "\n".join(RUN.splitlines()[:4]) + "\nKeyboardInterrupt\n"
    assert summary(tmp_path, {"extender-5000-2000.log": cut, "extender-1000-1000.log": RUN}) == [
        "| 5,000, 2,000 | 623 pods/s | – | **–** | – | – | – | – |",
        "| 1,000, 1,000 | 623 pods/s | 231 pods/s | **179 pods/s** | 0.77 | 0.29 | 0.6 ms "
        "| 2.3 ms |"]
