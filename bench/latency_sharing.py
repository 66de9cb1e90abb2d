"""Sharing a GPU by latency objectives: Carpool's choice against fixed degrees 1 to 6.

A lab's cluster of `--gpus` GPUs serves inference services (a ResNet-50-shaped conv net and a
transformer encoder, each at batch sizes 1, 8 and 32) that arrive one after another, more of
them than the cluster can hold, each with a P99 target. Every policy places them online, in
arrival order, with the placement core's own sharing rule (`placement.gpu_rejection` over
logical GPUs of one node); a service that fits on none of the cluster's GPUs waits and is not
served here. A fixed degree d gives every service a sharing limit of d and packs first fit;
Carpool gives each service the limit its template's interference profile allows for its
objective and its weight as a sharer (`core.interference`) and takes the GPU its extender
would (`gpu_choice.choose_gpus`: where the service uses up the least of the sharing budgets),
the profile learned from a short profiling run (each template alone and 2..P at a time, and
each pair of templates once) and then from what its own services report where it placed them,
a few times over (`--learn-rounds`; both times are reported). A limit may lie between two
degrees (a light neighbour counts as less than one copy); the row "whole degrees" cuts each
to the degree below, to show what that adds. Each report names its neighbours' templates, as
the node agent records them, so Carpool also learns pairs (how many copies of a service each
neighbour template counts as); the row "by weight only" learns from the same reports as if
none named its company, every neighbour counted by weight, and the row "first fit" places
Carpool's limits first fit, to show what the GPU choice adds. Then each policy's GPUs are
measured, one
logical GPU after the other on the one physical GPU (a logical GPU holds what the real one's
memory holds, at most 8 services, the pool's size): its services serve requests back to back
together for `--seconds`, from a pool of host processes each started with the environment the
device plugin's Allocate answered (over its real gRPC socket) for an MPS pod of 10 GiB; on the
GPU each process serves every template from a CUDA graph (`--eager`: kernel by kernel). Rounds
alternate the policies. Reported per policy: services served, the GPUs it would need to serve
every arrival, services whose P99 over all they served (every round pooled, as an SLO is
judged) broke their target, the worst P99 / target, the most services over target within one
round, and the cluster's throughput, median and range over rounds, in two units: work (each
service's requests/s over its template's alone, summed: 1.0 is one service running alone) and
samples/s (which a batch-32 service dominates). Every policy has the same GPUs, so throughput
compares directly, and no policy's last GPU is left part full. Services that broke their
target running alone (fixed degree 1) in a round are named: that is the machine's noise floor.

The targets are set from what the profiling run measured alone, the median of `--alone-runs`
runs (`--targets`: factors of each template's P99 alone, cycled over the services), so they
mean the same on any GPU.

With `--load F` a service serves requests that arrive instead of back to back: each is
offered F of what its template serves alone back to back (measured first), as a Poisson
stream, and a request's latency includes its wait in the queue; work is then 1.0 for a service
served all it was offered.

  python3 bench/latency_sharing.py                       # on the GPU machine (CUDA, MPS)
  python3 bench/latency_sharing.py --device cpu --small  # the logic, anywhere (no GPU)

`--device cpu` runs tiny models on the CPU (torch if importable, else a pure-Python stand-in,
said so in the output), with the fake backend's Allocate answers and no MPS: it checks the
script, its numbers say nothing about GPUs. Needs the `carpool` package importable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

WORKER_FLAG = "--worker"
MODELS = ("resnet", "encoder")
BATCHES = (1, 8, 32)
DEGREES = 6  # fixed degrees 1..6, and the profiling run's largest degree
POOL = 8  # worker processes: the most services one GPU carries in a measured run
GRANT_MIB = 10 * 1024  # each service's MPS grant


# --- worker side: one serving process, told which template to serve and for how long ----------


def _torch_models(device: str, small: bool) -> dict[str, Any]:
    """The two model shapes, built with torch.nn (no torchvision), in eval mode on `device`."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):  # type: ignore[misc]  # torch is untyped here
        def __init__(self, cin: int, mid: int, stride: int) -> None:
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                nn.ReLU(inplace=True), nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Identity() if cin == cout and stride == 1 else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x: Any) -> Any:
            return torch.relu(self.body(x) + self.skip(x))

    def resnet(width: int, blocks: tuple[int, ...]) -> nn.Module:
        layers: list[nn.Module] = [nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                   nn.MaxPool2d(3, 2, 1)]
        cin = width
        for stage, count in enumerate(blocks):
            mid = width * 2 ** stage
            for n in range(count):
                layers.append(Bottleneck(cin, mid, 2 if n == 0 and stage > 0 else 1))
                cin = mid * 4
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
        return nn.Sequential(*layers)

    if small:
        conv, image = resnet(8, (1, 1, 1, 1)), 32
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            64, 4, 128, batch_first=True), 2, enable_nested_tensor=False)
        tokens, width = 16, 64
    else:  # ResNet-50's stages and widths; a BERT-base-sized encoder of 6 layers
        conv, image = resnet(64, (3, 4, 6, 3)), 224
        encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(
            768, 12, 3072, batch_first=True), 6, enable_nested_tensor=False)
        tokens, width = 128, 768
    dtype = torch.float16 if device == "cuda" else torch.float32
    conv = conv.to(device, dtype).eval()
    encoder = encoder.to(device, dtype).eval()
    if device == "cuda":
        conv = conv.to(memory_format=torch.channels_last)
    inputs: dict[str, Any] = {}
    for batch in BATCHES:
        image_in = torch.randn(batch, 3, image, image, device=device, dtype=dtype)
        if device == "cuda":
            image_in = image_in.to(memory_format=torch.channels_last)
        inputs[f"resnet-b{batch}"] = (conv, image_in)
        inputs[f"encoder-b{batch}"] = (encoder, torch.randn(batch, tokens, width,
                                                             device=device, dtype=dtype))
    return inputs


def _standin_models() -> dict[str, Any]:
    """Without torch (`--device cpu` only): pure-Python work in proportion to each template's
    batch, so that processes contend for the CPU as services contend for a GPU."""
    def work(turns: int) -> Any:
        def forward() -> float:
            total = 0.0
            for n in range(turns):
                total += n * 0.5
            return total
        return forward
    return {f"{m}-b{b}": (work((600 if m == "resnet" else 400) * (4 + b)), None)
            for m in MODELS for b in BATCHES}


def _graphed(torch: Any, model: Any, data: Any) -> Any:
    """`model(data)` captured once as a CUDA graph: a request replays it. Latency-sensitive
    servers run this way so that a request's time is the GPU's, not the Python launcher's;
    served eagerly, a batch-1 model's tail is mostly host jitter, which no placement can
    change and which would drown the interference being measured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(data)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(data)
    return graph.replay


def worker_main(device: str, small: bool, graphs: bool) -> int:
    """Load every template once (captured as a CUDA graph where `graphs`), warm it, say
    ready; then serve what each command says: `{"template", "seconds", "start"}` (epoch
    seconds to begin, so a group starts together) answers
    `{"result": {"requests", "seconds", "latencies_ms"}}`."""
    import gc

    torch: Any = None
    try:
        import torch as torch_module
        torch = torch_module
    except ImportError:
        if device == "cuda":
            raise
    if torch is not None:
        torch.set_num_threads(1)
        torch.backends.cudnn.benchmark = True
        models = _torch_models(device, small)
    else:
        models = _standin_models()

    graphs = graphs and torch is not None and device == "cuda"
    forwards: dict[str, Any] = {}
    sync = (torch.cuda.synchronize if torch is not None and device == "cuda"
            else (lambda: None))
    context = torch.inference_mode() if torch is not None else _nothing()
    with context:
        for template, (model, data) in models.items():
            forward = model if data is None else (lambda m=model, d=data: m(d))
            for _ in range(5 if small else 20):
                forward()
            sync()
            forwards[template] = _graphed(torch, model, data) if graphs else forward
        for forward in forwards.values():
            forward()
        sync()
        gc.collect()
        gc.freeze()
        engine = ("torch, CUDA graphs" if graphs else "torch" if torch is not None
                  else "python")
        print(json.dumps({"ready": True, "engine": engine}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            forward = forwards[command["template"]]
            seconds = float(command["seconds"])
            time.sleep(max(0.0, float(command["start"]) - time.time()))
            gc.disable()
            if command.get("rate"):
                served, latencies = _serve_arrivals(forward, sync, seconds,
                                                    float(command["rate"]), command["seed"])
            else:
                latencies = []
                end = time.perf_counter() + seconds
                while (now := time.perf_counter()) < end:
                    forward()
                    sync()
                    latencies.append(time.perf_counter() - now)
                served = len(latencies)
            gc.enable()
            print(json.dumps({"result": {"requests": served, "seconds": seconds,
                                         "latencies_ms": [round(x * 1000, 4)
                                                          for x in latencies]}}), flush=True)
    return 0


def _serve_arrivals(forward: Any, sync: Any, seconds: float, rate: float,
                    seed: int) -> tuple[int, list[float]]:
    """Serve requests arriving as a Poisson stream of `rate` per second for `seconds`, one at
    a time in arrival order, as a service's server does: a request's latency runs from its
    arrival, its wait in the queue included. Requests still queued when the time is up count
    with the time they had waited by then (a lower bound), so a server that cannot keep up
    shows it in its tail; the served count is the throughput."""
    import random

    arrival_gap = random.Random(seed).expovariate
    begin = time.perf_counter()
    end = begin + seconds
    arrival = begin + arrival_gap(rate)
    latencies: list[float] = []
    served = 0
    while arrival < end:
        now = time.perf_counter()
        if now < arrival:
            if arrival - now > 0.0005:
                time.sleep(arrival - now - 0.0003)
            while time.perf_counter() < arrival:
                pass
        elif now >= end:
            break
        forward()
        sync()
        latencies.append(time.perf_counter() - arrival)
        served += 1
        arrival += arrival_gap(rate)
    while arrival < end:  # the backlog when the time ran out
        latencies.append(end - arrival)
        arrival += arrival_gap(rate)
    return served, latencies


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --- parent side ------------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"[{datetime.now(UTC).strftime('%H:%M:%S')}] {text}", flush=True)


@dataclass(frozen=True)
class Service:
    name: str
    template: str  # "<model>-b<batch>"
    p99_target_s: float = 0.0
    alone_per_s: float = 0.0  # its template's requests/s running alone (the profiling run's)

    @property
    def batch(self) -> int:
        return int(self.template.rsplit("-b", 1)[1])


@dataclass
class Measure:
    """One service's run in one group: what it served."""

    requests: int
    seconds: float
    latencies_s: list[float]

    @property
    def p99_s(self) -> float:
        from carpool.core.service_levels import Histogram

        p99 = Histogram.of(self.latencies_s).quantile(0.99)
        return p99 if p99 is not None else 0.0

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds


@dataclass
class Pool:
    """The serving processes, each started with one pod's Allocate environment."""

    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    engine: str = ""
    # a template's offered requests/s where its services serve arriving requests; a template
    # not here is served back to back (a closed loop: as fast as the GPU lets it)
    rates: dict[str, float] = field(default_factory=dict)

    @classmethod
    def start(cls, envs: list[dict[str, str]], device: str, small: bool,
              graphs: bool) -> Pool:
        pool = cls()
        for env in envs:
            pool.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), WORKER_FLAG, device,
                 "small" if small else "full", "graphs" if graphs else "eager"],
                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1))
        for proc in pool.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith('{"ready"'):
                pool.stop()
                raise RuntimeError(f"a worker did not get ready: {line!r}")
            pool.engine = json.loads(line)["engine"]
        return pool

    def run(self, templates: list[str], seconds: float) -> list[Measure]:
        """Serve `templates` together, one per worker, for `seconds`."""
        if len(templates) > len(self.procs):
            raise ValueError(f"{len(templates)} services on one GPU, the pool has "
                             f"{len(self.procs)} workers")
        start = time.time() + 0.2
        for slot, (proc, template) in enumerate(zip(self.procs, templates, strict=False)):
            assert proc.stdin is not None
            command = {"template": template, "seconds": seconds, "start": start}
            if template in self.rates:  # one stream per slot and template, whatever the call
                command.update(rate=self.rates[template], seed=f"{template}/{slot}")
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        out = []
        for proc in self.procs[:len(templates)]:
            assert proc.stdout is not None
            result = json.loads(proc.stdout.readline())["result"]
            out.append(Measure(result["requests"], result["seconds"],
                               [x / 1000 for x in result["latencies_ms"]]))
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.write(json.dumps({"quit": True}) + "\n")
                proc.stdin.flush()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def arrivals(count: int) -> list[str]:
    """Templates in arrival order: models and batch sizes interleaved."""
    order = [f"{m}-b{b}" for b in BATCHES for m in MODELS]
    return [order[(n * 5) % len(order)] for n in range(count)]


def profile(pool: Pool, templates: list[str], degrees: int, seconds: float, model: str,
            alone_runs: int) -> tuple[list[Any], dict[str, tuple[float, float]]]:
    """Each template alone (`alone_runs` times) and 2..`degrees` at a time: samples for
    `core.interference`, and each template's P99 and requests/s alone, the medians of its
    alone runs (one short run can catch the machine in a slow moment, and the targets and
    the work's unit are set from them)."""
    from carpool.core.interference import Sample

    samples: list[Sample] = []
    alone = {}
    for template in templates:
        for degree in range(1, degrees + 1):
            runs = [pool.run([template] * degree, seconds)
                    for _ in range(alone_runs if degree == 1 else 1)]
            measures = [m for run in runs for m in run]
            for n, run in enumerate(runs):  # the copies of one run shared one company
                samples.extend(Sample(model, template, degree, m.req_per_s, m.p99_s,
                                      f"profile {template} x{degree} #{n}",
                                      (template,) * (degree - 1)) for m in run)
            if degree == 1:
                alone[template] = (statistics.median(m.p99_s for m in measures),
                                   statistics.median(m.req_per_s for m in measures))
            log(f"    {template} x{degree}: "
                f"{statistics.median(m.req_per_s for m in measures):.1f} req/s each, P99 "
                f"{statistics.median(m.p99_s for m in measures) * 1000:.2f} ms")
    return samples, alone


def profile_pairs(pool: Pool, templates: list[str], seconds: float, model: str) -> list[Any]:
    """Each template beside one job of each other template, once: what a new template's
    profiling run adds where the cluster already serves others, so that pairs are known
    before any placement has tried them (`core.interference` learns them from reports that
    name their neighbours)."""
    from carpool.core.interference import Sample

    samples = []
    for n, first in enumerate(templates):
        for second in templates[n + 1:]:
            measures = pool.run([first, second], seconds)
            for template, other, m in ((first, second, measures[0]),
                                       (second, first, measures[1])):
                samples.append(Sample(model, template, 2, m.req_per_s, m.p99_s,
                                      f"pair {first}+{second}", (other,)))
            log(f"    {first} + {second}: P99 {measures[0].p99_s * 1000:.2f} / "
                f"{measures[1].p99_s * 1000:.2f} ms")
    return samples


def place(services: list[Service], request_of: Any, model: str, memory_mib: int,
          gpus: int | None = None, first_fit: bool = True) -> list[list[Service]]:
    """Online placement in arrival order over `gpus` logical GPUs like the real one (`model`,
    `memory_mib`; None: as many as it takes), one node of them, by the placement core's rule
    (`gpu_rejection`: memory, each service's sharing limit and weight and those of the
    services there); `request_of` gives a service's one-GPU request. `first_fit`: the
    lowest-numbered GPU that accepts (the fixed degrees, as a sharing-by-count plugin packs);
    else the GPU the extender and the operator choose (`gpu_choice.choose_gpus`). A service no
    GPU takes is left out (it waits); the groups are the GPUs in use, in the order first used."""
    from carpool.core.derived import DerivedState
    from carpool.core.gpu_choice import NoFit, choose_gpus, grants_for
    from carpool.core.placement import NodeState, gpu_rejection, grant_for
    from carpool.core.resources import Gpu, GpuGrant, NodeInventory
    from carpool.core.scoring import RequestScorer, Scorer

    count = len(services) if gpus is None else gpus
    state = NodeState(NodeInventory("bench", tuple(
        Gpu(i, f"gpu-{i}", model, memory_mib) for i in range(count))))
    on: dict[int, list[Service]] = {}
    scorer = Scorer()
    for service in services:
        request = request_of(service)
        grants: tuple[GpuGrant, ...]
        if first_fit:
            frees = state.free()
            index = next((i for i, free in enumerate(frees)
                          if gpu_rejection(free, request) is None), None)
            grants = () if index is None else (grant_for(frees[index], request),)
        else:
            derived = DerivedState.of(state)
            choice = choose_gpus(derived, RequestScorer(request, scorer))
            index = None if isinstance(choice, NoFit) else choice[1][0]
            grants = () if isinstance(choice, NoFit) else grants_for(derived, request, choice[1])
        if index is None:
            continue
        on.setdefault(index, []).append(service)
        state = state.with_grants(grants)
    return list(on.values())


def allocate_envs(device: str, pipe_dir: Path
                  ) -> tuple[list[dict[str, str]], tuple[str, int], Any]:
    """The pool's environments from the device plugin's Allocate answers (pods svc-0..7,
    MPS, 10 GiB each) through its gRPC socket, and the GPU's model and memory; on `cpu`, the
    fake backend's answers (and no MPS: the variables are dropped)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_sharing

    requests = [(f"svc-{n}", "mps", GRANT_MIB, 100) for n in range(POOL)]
    if device == "cuda":
        from carpool.deviceplugin.backends.nvml import NvmlBackend

        backend: Any = NvmlBackend()
    else:
        from carpool.deviceplugin.backends.fake import FakeBackend

        backend = FakeBackend.from_spec({"node": "bench-node", "gpus": [{"model": "H200"}]})
    answers = asyncio.run(gpu_sharing.plugin_allocations(backend, pipe_dir, requests))
    facts = backend.inventory()[0]
    envs = []
    for answer in answers:
        env = gpu_sharing.host_env(answer)
        if device != "cuda":
            env = {k: v for k, v in env.items()
                   if not k.startswith("CUDA_") and k != "NVIDIA_VISIBLE_DEVICES"}
        envs.append(gpu_sharing.client_env(env))
    return envs, (facts.model, facts.memory_total_mib), backend


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        return worker_main(sys.argv[2], sys.argv[3] == "small", sys.argv[4] == "graphs")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny models (checks the logic)")
    parser.add_argument("--eager", action="store_true",
                        help="serve eagerly instead of replaying CUDA graphs (on cuda)")
    parser.add_argument("--gpus", type=int, default=3,
                        help="the cluster's GPUs, the same for every policy")
    parser.add_argument("--services", type=int, default=24,
                        help="services arriving (more than a sparing policy's GPUs hold)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per measured GPU")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile-seconds", type=float, default=2.0)
    parser.add_argument("--profile-degrees", type=int, default=DEGREES,
                        help="the profiling run measures each template at 1..this degree")
    parser.add_argument("--alone-runs", type=int, default=3,
                        help="runs of each template alone; their median P99 sets its targets")
    parser.add_argument("--profile-pairs", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="the profiling run also measures each pair of templates once")
    parser.add_argument("--pair-seconds", type=float, default=4.0,
                        help="each pair's run: longer than a degree's, for a pair's count is "
                             "read where a light template's curve is flat, so a small error in "
                             "a short run's P99 moves it by whole copies")
    parser.add_argument("--learn-rounds", type=int, default=3,
                        help="Carpool places, its services report, it learns: this often "
                             "before the measured rounds")
    parser.add_argument("--load", type=float, default=0.0,
                        help="each service is offered this share of what its template serves "
                             "alone back to back, as a Poisson stream of requests (0: every "
                             "service serves back to back, as fast as its GPU lets it)")
    parser.add_argument("--targets", default="2,3,5",
                        help="P99 targets as factors of each template's P99 alone, cycled")
    parser.add_argument("--json", type=Path, help="also write all results here")
    parser.add_argument("--judge", type=Path, metavar="RUN_JSON",
                        help="no GPU: replay the sharing rule on a past run's --json, learned "
                             "with pairs and by weight only, on every GPU of its fixed degrees")
    args = parser.parse_args()
    if args.judge:
        print_judged(judge(json.loads(args.judge.read_text())), args.judge)
        return 0
    began = time.monotonic()
    from carpool.core.interference import learn
    from carpool.core.resources import Objectives

    report: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "args": {k: str(v) for k, v in vars(args).items()}}
    mps_root = Path(tempfile.mkdtemp(prefix="carpool-mps-", dir="/tmp"))
    pipe_dir, log_dir = mps_root / "pipe", mps_root / "log"
    envs, (model, memory_mib), backend = allocate_envs(args.device, pipe_dir)
    log(f"Allocate answered for {POOL} MPS pods of {GRANT_MIB // 1024} GiB on a {model}: "
        f"{json.dumps({k: v for k, v in envs[0].items() if k.startswith('CUDA')})}")
    daemon = None
    if args.device == "cuda":
        sys.path.insert(0, str(Path(__file__).parent))
        import gpu_sharing

        from carpool.deviceplugin.mps import MpsDaemon

        daemon = MpsDaemon(pipe_dir, log_dir, binary=gpu_sharing.find_mps_control())
        daemon.start()
    try:
        pool = Pool.start(envs, args.device, args.small, not args.eager)
        log(f"{POOL} serving processes ready ({pool.engine}, {args.device}), "
            f"{time.monotonic() - began:.0f}s in")
        try:
            report.update(run(pool, args, (model, memory_mib), Objectives, learn))
        finally:
            pool.stop()
    finally:
        if daemon is not None:
            daemon.stop()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    report["seconds_total"] = round(time.monotonic() - began, 1)
    print_report(report, model, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0


def run(pool: Pool, args: argparse.Namespace, gpu: tuple[str, int], objectives_type: Any,
        learn: Any) -> dict[str, Any]:
    from carpool.core.interference import Sample, limited, report_degree
    from carpool.core.placement import counted_sharers
    from carpool.core.resources import GpuRequest

    model, memory_mib = gpu
    # a logical GPU holds what the real one's memory holds, and no more than the pool serves
    memory_mib = min(memory_mib, POOL * GRANT_MIB)
    templates = arrivals(args.services)
    kinds = sorted(set(templates), key=templates.index)
    started = time.monotonic()
    capacity = {}
    if args.load > 0:
        for template in kinds:
            capacity[template] = pool.run([template], args.profile_seconds)[0].req_per_s
            pool.rates[template] = args.load * capacity[template]
        log("offered loads: " + ", ".join(f"{t} {pool.rates[t]:.0f} req/s of "
                                          f"{capacity[t]:.0f}" for t in kinds))
    log(f"profiling {len(kinds)} templates at 1..{args.profile_degrees} "
        f"({args.profile_seconds:g}s each)")
    samples, alone = profile(pool, kinds, args.profile_degrees, args.profile_seconds, model,
                             args.alone_runs)
    if args.profile_pairs:
        log(f"profiling {len(kinds) * (len(kinds) - 1) // 2} pairs of templates "
            f"({args.pair_seconds:g}s each)")
        samples.extend(profile_pairs(pool, kinds, args.pair_seconds, model))
    profiling_s = time.monotonic() - started
    factors = [float(x) for x in args.targets.split(",")]
    services = [Service(f"{t}#{n}", t, alone[t][0] * factors[n % len(factors)], alone[t][1])
                for n, t in enumerate(templates)]

    def carpool_requests(by_weight_only: bool = False) -> dict[str, Any]:
        """Each service's request with the limit, weight and pairs its template's profile
        gives (`by_weight_only`: learned from the same reports as if none named its company,
        every neighbour counted by weight)."""
        profiles = learn([replace(s, neighbours=()) for s in samples] if by_weight_only
                         else samples)
        return {s.name: limited(GpuRequest(1, GRANT_MIB, 0,
                                           objectives=objectives_type(s.p99_target_s)),
                                s.template, profiles) for s in services}

    # Carpool learns on: its services run where it put them and report, in the company they
    # found there (what the node agent records in a cluster), and it places again
    started = time.monotonic()
    learning: list[list[dict[str, Any]]] = []  # per round, per GPU: who shared it and how
    for learned in range(args.learn_rounds):
        requests = carpool_requests()
        groups = place(services, lambda s, known=requests: known[s.name], model, memory_mib,
                       args.gpus, first_fit=False)
        learning.append([])
        for index, group in enumerate(groups):
            measures = pool.run([s.template for s in group], args.seconds)
            weights = [requests[s.name].sharing_weight(model) for s in group]
            for n, (service, m) in enumerate(zip(group, measures, strict=True)):
                # as the node agent records it: the jobs on the GPU counted by weight
                counted = counted_sharers(weights[n], [*weights[:n], *weights[n + 1:]])
                samples.append(Sample(model, service.template,
                                      report_degree(len(group), counted), m.req_per_s,
                                      m.p99_s, f"learning {learned} GPU {index}",
                                      tuple(sorted(s.template for k, s in enumerate(group)
                                                   if k != n))))
            learning[-1].append(_company(group, measures, requests, model))
        log(f"  learning {learned + 1}/{args.learn_rounds}: {len(groups)} GPUs")
    learning_s = time.monotonic() - started
    requests = carpool_requests()
    request_of: dict[str, Any] = {}
    for degree in range(1, DEGREES + 1):
        fixed = GpuRequest(1, GRANT_MIB, 0, sharing_limits=((model, degree),))
        request_of[f"fixed {degree}"] = lambda s, r=fixed: r
    request_of["carpool"] = lambda s: requests[s.name]
    # the same limits placed first fit: what choosing the GPU by sharing cost adds
    request_of["carpool, first fit"] = lambda s: requests[s.name]
    # the same profiles with each limit cut to a whole degree: what limits between two degrees
    # add (a light neighbour beside a job whose objective breaks at one more copy)
    whole = {name: replace(r, sharing_limits=tuple((m, math.floor(x))
                                                   for m, x in r.sharing_limits))
             for name, r in requests.items()}
    request_of["carpool, whole degrees"] = lambda s: whole[s.name]
    # the same reports learned as if none named its company: every neighbour counted by weight
    weighed = carpool_requests(by_weight_only=True)
    request_of["carpool, by weight only"] = lambda s: weighed[s.name]
    chosen = {name: name.startswith("carpool") and name != "carpool, first fit"
              for name in request_of}
    policies = {name: place(services, of, model, memory_mib, args.gpus,
                            first_fit=not chosen[name])
                for name, of in request_of.items()}
    needed = {name: len(place(services, of, model, memory_mib, first_fit=not chosen[name]))
              for name, of in request_of.items()}
    for name, groups in policies.items():
        log(f"  {name}: {sum(map(len, groups))} served on {len(groups)} GPUs (all "
            f"{len(services)}: {needed[name]} GPUs): "
            + " | ".join(",".join(s.name for s in g) for g in groups))
    measured: dict[str, list[dict[str, Measure]]] = {name: [] for name in policies}
    for round_no in range(1, args.rounds + 1):
        order = list(policies) if round_no % 2 else list(reversed(policies))
        log(f"round {round_no}/{args.rounds}: {sum(len(policies[p]) for p in order)} GPUs "
            f"x {args.seconds:g}s")
        for name in order:
            one: dict[str, Measure] = {}
            for group in policies[name]:
                for service, m in zip(group, pool.run([s.template for s in group],
                                                      args.seconds), strict=True):
                    one[service.name] = m
            measured[name].append(one)
    rows = {}
    for name, groups in policies.items():
        rows[name] = summarize([s for g in groups for s in g], groups, measured[name])
        rows[name]["gpus_for_all"] = needed[name]
    return {"model": model, "profiling_s": round(profiling_s, 1),
            "learning_s": round(learning_s, 1),
            "offered_per_s": {t: round(r, 2) for t, r in pool.rates.items()},
            "capacity_per_s": {t: round(r, 2) for t, r in capacity.items()},
            "profile": [{"template": s.template, "degree": s.degree,
                         "req_per_s": round(s.throughput, 2),
                         "p99_ms": None if s.p99_s is None else round(s.p99_s * 1000, 3),
                         "company": s.company, "neighbours": list(s.neighbours)}
                        for s in samples],
            "services": [{"name": s.name, "template": s.template,
                          "p99_target_ms": round(s.p99_target_s * 1000, 3),
                          "limit": dict(requests[s.name].sharing_limits),
                          "weight": dict(requests[s.name].sharing_weights),
                          "felt_by": {m: dict(f) for m, f in requests[s.name].sharing_felt_by},
                          "limit_by_weight_only": dict(weighed[s.name].sharing_limits)}
                         for s in services],
            "learning": learning,
            "policies": rows}


def _company(group: list[Service], measures: list[Measure], requests: dict[str, Any],
             model: str) -> dict[str, Any]:
    """One learning GPU as recorded: each service's limit and weight then, and what it
    served in that company (so a rule that reads company can be checked on a past run)."""
    return {s.name: {"limit": requests[s.name].sharing_limit(model),
                     "weight": requests[s.name].sharing_weight(model),
                     "p99_ms": round(m.p99_s * 1000, 3), "req_per_s": round(m.req_per_s, 2)}
            for s, m in zip(group, measures, strict=True)}


def summarize(services: list[Service], groups: list[list[Service]],
              rounds: list[dict[str, Measure]]) -> dict[str, Any]:
    """A service's objective is judged as an SLO is, on its P99 over everything it served in
    the run (all rounds pooled); the rounds' own counts and samples/s show the spread."""
    per_round: list[dict[str, Any]] = []
    for one in rounds:
        broken = [s.name for s in services if one[s.name].p99_s > s.p99_target_s]
        samples = sum(one[s.name].req_per_s * s.batch for s in services)
        work = sum(one[s.name].req_per_s / s.alone_per_s for s in services)
        worst = max(one[s.name].p99_s / s.p99_target_s for s in services)
        per_round.append({"violations": len(broken), "broken": broken,
                          "samples_per_s": samples, "work": work,
                          "worst_p99_vs_target": worst})
    pooled = {s.name: Measure(sum(r[s.name].requests for r in rounds),
                              sum(r[s.name].seconds for r in rounds),
                              [x for r in rounds for x in r[s.name].latencies_s])
              for s in services}
    broken = [s.name for s in services if pooled[s.name].p99_s > s.p99_target_s]
    return {"gpus": len(groups), "served": len(services),
            "groups": [[s.name for s in g] for g in groups],
            "rounds": per_round,
            "p99_vs_target": {s.name: round(pooled[s.name].p99_s / s.p99_target_s, 4)
                              for s in services},
            "per_s_vs_alone": {s.name: round(pooled[s.name].req_per_s / s.alone_per_s, 4)
                               for s in services},
            "violations": len(broken), "broken": broken,
            "worst_p99_vs_target": max(pooled[s.name].p99_s / s.p99_target_s
                                       for s in services),
            "round_violations_max": max(r["violations"] for r in per_round),
            "samples_per_s": statistics.median(r["samples_per_s"] for r in per_round),
            "samples_per_s_range": [min(r["samples_per_s"] for r in per_round),
                                    max(r["samples_per_s"] for r in per_round)],
            "work": statistics.median(r["work"] for r in per_round),
            "work_range": [min(r["work"] for r in per_round),
                           max(r["work"] for r in per_round)]}


def print_report(report: dict[str, Any], model: str, args: argparse.Namespace) -> None:
    rows = report["policies"]
    print()
    mode = args.device + (", small models" if args.small else "")
    offered = (f"each offered {args.load:.0%} of its template's rate alone as Poisson "
               "arrivals" if args.load > 0 else "each serving back to back")
    print(f"Latency objectives on a cluster of {args.gpus} {model} ({mode}; one physical "
          f"GPU measured in turn), {args.services} services arriving ({offered}), "
          f"{args.rounds} rounds x {args.seconds:g}s per GPU; "
          f"profiling {report['profiling_s']:g}s and learning {report['learning_s']:g}s; "
          f"{report['seconds_total']:g}s in all")
    print()
    print(f"| policy | services served | GPUs for all {args.services} | services over P99 "
          "target | worst P99 / target | over target in one round (max) | work, alone-rate "
          "units (range) | samples/s (range) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        low, high = r["samples_per_s_range"]
        work_low, work_high = r["work_range"]
        print(f"| {name} | {r['served']} | {r['gpus_for_all']} | {r['violations']} | "
              f"{r['worst_p99_vs_target']:.2f} | {r['round_violations_max']} | "
              f"{r['work']:.2f} ({work_low:.2f}-{work_high:.2f}) | "
              f"{r['samples_per_s']:.0f} ({low:.0f}-{high:.0f}) |")
    alone = rows["fixed 1"]["rounds"]
    if any(r["broken"] for r in alone):
        print()
        print("running alone, these services broke their own target in a round (the machine's "
              "noise, not sharing): "
              + "; ".join(f"round {n}: {', '.join(r['broken'])}"
                          for n, r in enumerate(alone, 1) if r["broken"]))
    clean = [r for name, r in rows.items() if name.startswith("fixed") and r["violations"] == 0]
    if clean:
        print()
        for unit, key in (("work", "work"), ("samples/s", "samples_per_s")):
            carpool = rows["carpool"][key]
            best = max(r[key] for r in clean)
            beats = all(carpool > rows[f"fixed {d}"][key] for d in (1, 3))
            print(f"goal ({unit}): Carpool breaks no objective: "
                  f"{rows['carpool']['violations'] == 0}; on the same GPUs it delivers "
                  f"{carpool / best:.0%} of the best fixed degree that breaks none (>= 90 %: "
                  f"{carpool >= 0.9 * best}); more than fixed 1 and 3: {beats}")

def judge(run: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The sharing rule, learned from a past run's profiling and learning reports (with
    pairs, and by weight only), judged on every service of every GPU of the run's fixed
    degrees 2 and up, companies the learning never placed: whether its limit, counted as the
    rule counts, takes that company (accepted) against whether it kept its target there."""
    from carpool.core.interference import Sample, learn, limited, report_degree
    from carpool.core.placement import counted_sharers, within_limit
    from carpool.core.resources import GpuRequest, Objectives

    model = run["model"]
    services = {s["name"]: s for s in run["services"]}
    samples = []
    for s in run["profile"]:  # the degrees and the measured pairs, each in its company
        p99 = None if s["p99_ms"] is None else s["p99_ms"] / 1000
        samples.append(Sample(model, s["template"], s["degree"], s["req_per_s"], p99,
                              s["company"], tuple(s["neighbours"])))
    for n, gpus in enumerate(run["learning"]):
        for index, group in enumerate(gpus):
            for name, measured in group.items():
                others = [o for o in group if o != name]
                counted = counted_sharers(measured["weight"],
                                          [group[o]["weight"] for o in others])
                samples.append(Sample(
                    model, services[name]["template"], report_degree(len(group), counted),
                    measured["req_per_s"], measured["p99_ms"] / 1000,
                    f"learning {n} GPU {index}",
                    tuple(sorted(services[o]["template"] for o in others))))
    out = {}
    for rule, learned in (("pairs", samples),
                          ("by weight only", [replace(s, neighbours=()) for s in samples])):
        profiles = learn(learned)
        sharers = {name: limited(GpuRequest(1, GRANT_MIB, 0, objectives=Objectives(
            s["p99_target_ms"] / 1000)), s["template"], profiles).sharer(model)
                   for name, s in services.items()}
        counts = {"accepted, kept": 0, "accepted, broke": 0, "refused, kept": 0,
                  "refused, broke": 0}
        for policy, row in run["policies"].items():
            if not policy.startswith("fixed") or policy == "fixed 1":
                continue
            for group in row["groups"]:
                for name in group:
                    me = sharers[name]
                    accepted = not me.limit or within_limit(
                        me, [sharers[o] for o in group if o != name])
                    kept = row["p99_vs_target"][name] <= 1.0
                    counts[f"{'accepted' if accepted else 'refused'}, "
                           f"{'kept' if kept else 'broke'}"] += 1
        out[rule] = counts
    return out


def print_judged(judged: dict[str, dict[str, int]], path: Path) -> None:
    print(f"The sharing rule on the fixed degrees' GPUs of {path}:")
    print()
    print("| rule | accepted: kept / broke | refused: kept / broke |")
    print("|---|---:|---:|")
    for rule, c in judged.items():
        print(f"| {rule} | {c['accepted, kept']} / {c['accepted, broke']} | "
              f"{c['refused, kept']} / {c['refused, broke']} |")


if __name__ == "__main__":
    sys.exit(main())
