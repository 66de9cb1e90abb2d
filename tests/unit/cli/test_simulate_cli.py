"""`carpool simulate queue`, the installed console script run as a process on small files:
one JSON object per policy with numbers checked by hand, the trace it writes, and the message
and exit status of bad input. Also the test bed's alias with the openb files as defaults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.replay import queue_replay as qr
from carpool_testbed.__main__ import main as carpool_testbed

CARPOOL = Path(sys.executable).parent / "carpool"
HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
          "creation_time,deletion_time,scheduled_time\n")
NODES_CSV = "sn,cpu_milli,memory_mib,gpu,model\nn1,64000,262144,2,T4\n"
# eight one-GPU jobs of 300 s, one every 10 s, on one node of two GPUs: every policy starts
# them two by two at 0, 10 | 300, 310 | 600, 610 | 900, 910
PODS_CSV = HEADER + "".join(f"p-{i},1000,1024,1,1000,,BE,Succeeded,{i * 10},{i * 10 + 300},"
                            f"{i * 10}\n" for i in range(8))


def carpool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    assert CARPOOL.is_file(), f"{CARPOOL} is missing: `make dev` installs the console script"
    return subprocess.run([str(CARPOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    trace, nodes = tmp_path / "pods.csv", tmp_path / "nodes.csv"
    trace.write_text(PODS_CSV)
    nodes.write_text(NODES_CSV)
    return trace, nodes


def test_prints_one_json_object_per_policy_with_the_waits_worked_out_by_hand(
        files: tuple[Path, Path]) -> None:
    trace, nodes = files
    done = carpool("simulate", "queue", "--trace", trace, "--nodes", nodes, "--scale", "1",
                   "--jobs", "2", "-o", "json")
    assert done.returncode == 0, done.stderr
    objects = [json.loads(line) for line in done.stdout.splitlines()]
    assert [o["policy"] for o in objects] == list(qr.POLICIES)
    for o in objects:
        for key in ("eta_median_abs_rel_error", "eta_p90_abs_rel_error",
                    "eta_interval_coverage", "wait_p50_s", "wait_p99_s", "gpu_utilization",
                    "preemptions", "gpu_hours_by_project", "cpu_seconds"):
            assert key in o, (o["policy"], key)
        # waits 0, 0, 280, 280, 560, 560, 840, 840 s; 2,400 GPU-s of work in 2 × 1,210 s
        assert (o["jobs"], o["jobs_waited_60s"], o["preemptions"]) == (8, 6, 0), o["policy"]
        assert sum(o["wait_p50_s"].values()) / len(o["wait_p50_s"]) <= 280
        assert max(o["wait_p99_s"].values()) == 840
        assert o["makespan_s"] == 1210
        assert o["gpu_utilization"] == pytest.approx(2400 / (2 * 1210))
        assert sum(o["gpu_hours_by_project"].values()) == pytest.approx(8 * 300 / 3600,
                                                                         abs=1e-2)
    assert objects[0]["eta_median_abs_rel_error"] is None  # FIFO gives no estimate
    progress = done.stderr.splitlines()
    assert len(progress) == len(qr.POLICIES), done.stderr
    assert {line.split(": ")[1].split()[0] for line in progress} == set(qr.POLICIES)


def test_the_written_generated_trace_replays_to_the_same_scores(
        files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, nodes = files
    written = tmp_path / "generated.csv"
    common = ("--nodes", nodes, "--scale", "1", "--policy", "fifo,carpool", "--jobs", "1",
              "--seed", "3", "-o", "json")
    generated = carpool("simulate", "queue", "--trace", trace, "--generate", "30",
                        "--write-trace", written, *common)
    assert generated.returncode == 0, generated.stderr
    assert len(written.read_text().splitlines()) == 1 + 30
    again = carpool("simulate", "queue", "--trace", written, *common)
    assert again.returncode == 0, again.stderr

    def scores(out: str) -> list[dict[str, object]]:
        return [{k: v for k, v in json.loads(line).items() if k != "cpu_seconds"}
                for line in out.splitlines()]

    assert scores(generated.stdout) == scores(again.stdout)
    assert [s["jobs"] for s in scores(again.stdout)] == [30, 30]


def test_a_share_of_jobs_reports_progress(files: tuple[Path, Path]) -> None:
    trace, nodes = files
    done = carpool("simulate", "queue", "--pods", trace, "--nodes", nodes, "--scale", "1",
                   "--jobs", "1", "--policy", "carpool", "--progress-share", "0.5")
    assert done.returncode == 0, done.stderr
    assert "seed 0, 50% reporting progress" in done.stdout.splitlines()[0]


def test_the_table_names_the_trace_and_every_policy(files: tuple[Path, Path]) -> None:
    trace, nodes = files
    done = carpool("simulate", "queue", "--pods", trace, "--nodes", nodes, "--scale", "1",
                   "--jobs", "1", "--policy", "slurm,carpool")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("pods.csv: 8 GPU jobs (0 never scheduled and 0 CPU-only")
    assert lines[1].split()[:3] == ["POLICY", "ETA", "ERR"]
    assert [line.split()[0] for line in lines[2:]] == ["slurm", "carpool"]


def test_idle_capacity_settings_add_their_columns(files: tuple[Path, Path]) -> None:
    trace, nodes = files
    done = carpool("simulate", "queue", "--pods", trace, "--nodes", nodes, "--scale", "1",
                   "--jobs", "1", "--policy", "carpool", "--lending", "--lend-whole-gpus",
                   "--right-sizing", "--idle-timeout", "30m")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "WORK GPU-H" in line)
    assert header.split()[-2:] == ["IDLE", "STOPPED"]


@pytest.mark.parametrize(("change", "message"), [
    ({"trace": None}, "no such file: {trace}"),
    ({"nodes": None}, "no such file: {nodes}"),
    ({"trace": "name,num_gpu\nx,1\n"}, "{trace}: trace lacks column(s) gpu_milli"),
    ({"trace": HEADER + "x,1000,1024,1,abc,,BE,Running,0,9,0\n"},
     "{trace}: line 2: gpu_milli='abc' is not a number"),
    ({"trace": HEADER}, "{trace}: the trace has no scheduled GPU pod"),
    ({"nodes": "sn,cpu_milli,memory_mib,model\nn1,1,1,T4\n"},
     "{nodes}: line 2: missing column 'gpu'"),
    ({"nodes": "sn,cpu_milli,memory_mib,gpu,model\nn1,1,1,0,T4\n"}, "{nodes}: no GPU nodes"),
    ({"args": ["--scale", "2"]}, "argument --scale: '2' must be in (0, 1]"),
    ({"args": ["--scale", "x"]}, "argument --scale: 'x' is not a number"),
    ({"args": ["--policy", "lsf"]}, "unknown policy 'lsf'; choose from fifo, slurm"),
    ({"args": ["--interarrival", "0"]}, "argument --interarrival: '0' must be more than 0"),
    ({"args": ["--progress-share", "1.5"]}, "argument --progress-share: '1.5' must be in [0, 1]"),
    ({"args": ["--idle-timeout", "30"]}, "argument --idle-timeout: not a duration"),
    ({"args": ["--generate", "5", "--write-trace", "/proc/no/such/dir/t.csv"]},
     "cannot write /proc/no/such/dir/t.csv"),
    ({"args": ["--generate", "2", "--load", "4", "--load-by-last-arrival"]},
     "--load 4.0: 2 jobs cannot keep"),
])
def test_bad_input_is_one_line_naming_it_and_exit_status_2(
        files: tuple[Path, Path], tmp_path: Path, change: dict[str, object],
        message: str) -> None:
    trace, nodes = files
    for name, path in (("trace", trace), ("nodes", nodes)):
        if name in change:
            text = change[name]
            if text is None:
                path.unlink()
            else:
                path.write_text(str(text))
    args = change.get("args", [])
    assert isinstance(args, list)
    done = carpool("simulate", "queue", "--trace", trace, "--nodes", nodes, "--jobs", "1",
                   *args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert message.format(trace=trace, nodes=nodes) in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(("carpool simulate queue: ", "usage: carpool simulate"))


def test_the_trace_and_node_list_are_required() -> None:
    done = carpool("simulate", "queue")
    assert done.returncode == 2
    assert "the following arguments are required: --trace/--pods, --nodes" in done.stderr


def test_the_test_bed_alias_defaults_to_the_openb_files(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert carpool_testbed(["simulate", "queue", "--limit", "40", "--policy", "fifo",
                            "--jobs", "1", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    (fifo,) = [json.loads(line) for line in out.splitlines()]
    assert (fifo["policy"], fifo["jobs"]) == ("fifo", 40)
    assert err.startswith("carpool-testbed simulate queue: fifo replayed")
