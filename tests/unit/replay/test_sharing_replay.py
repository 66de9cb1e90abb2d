"""The sharing replay (`carpool simulate sharing`): fixed degrees against Carpool's learned
limits on a generated trace, deterministic per seed."""

from __future__ import annotations

import pytest

from carpool.cli import main as cli
from carpool.replay import sharing_replay as sr


def test_truth_is_hidden_but_learned_and_kept() -> None:
    trace = sr.generate(120, seed=3, interarrival_s=120.0)
    assert trace == sr.generate(120, seed=3, interarrival_s=120.0)
    services = [j for j in trace if j.p99_target_s is not None]
    assert services and len(services) < len(trace)
    alone = sr.replay(trace, 8, "fixed-1", seed=3)
    assert alone.violation_minutes == 0  # running alone keeps every target
    packed = sr.replay(trace, 8, "fixed-6", seed=3)
    assert packed.violation_share > 0.5 and packed.work_per_hour > alone.work_per_hour
    carpool = sr.replay(trace, 8, "carpool", seed=3)
    assert carpool.profiles == len(sr.TEMPLATES)
    # what breaks targets is what was placed before a profile existed; after, almost nothing
    assert carpool.violation_minutes - carpool.violation_minutes_unprofiled \
        <= 0.01 * carpool.service_minutes
    assert carpool.work_per_hour > alone.work_per_hour
    with pytest.raises(ValueError, match="unknown policy"):
        sr.replay(trace, 8, "fixed-9")


def test_the_command_prints_one_line_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", "sharing", "--generate", "60", "--gpus", "4",
                     "--policy", "fixed-1,carpool"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("60 generated jobs") and out[1].split()[0] == "POLICY"
    assert [line.split()[0] for line in out[2:]] == ["fixed-1", "carpool"]
