"""`kubectl carpool`: the queue, why a job waits, quotas, GPU nodes and GPU-hour reports.

Installed as `kubectl-carpool` on PATH, so kubectl finds it as a plugin. Reads GpuJobs,
ProjectQuotas, GpuNodes and Pods; writes nothing. The reports themselves are pure functions
in `carpool.reporting`; this module only fetches objects and renders tables or JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TextIO

from carpool import reporting
from carpool.cli.tables import Table, render, render_csv, table
from carpool.core import names
from carpool.core.timestamps import epoch_of
from carpool.kube.errors import ApiError, Forbidden, NotFound, Unauthorized, Unreachable
from carpool.kube.resources import GPUJOBS, GPUNODES, PODS, PROJECTQUOTAS, Resource

if TYPE_CHECKING:
    from carpool.kube.client import Api

Obj = dict[str, Any]
REQUEST_TIMEOUT_S = 15


class PluginError(Exception):
    """A failure to show the user as one line (`error: ...`), exit status 1."""


class NotAllowed(PluginError):
    """The API server refused the read (RBAC): a namespace's user may list its own namespace
    but not all namespaces."""


class ClusterReader(Protocol):
    """What the plugin reads; a namespace of None means all namespaces."""

    def list_gpujobs(self, namespace: str | None) -> list[Obj]: ...

    def get_gpujob(self, namespace: str, name: str) -> Obj | None: ...

    def list_quotas(self) -> list[Obj]: ...

    def list_gpunodes(self) -> list[Obj]: ...

    def list_pods(self, namespace: str | None) -> list[Obj]:
        """The pods that can hold Carpool GPUs: those placed by Carpool's scheduler."""
        ...


class KubeReader:
    """`ClusterReader` over the API server (raw JSON: no model classes, fast for big lists)."""

    def __init__(self, api: Api) -> None:
        self.api = api

    def _call(self, what: str, path: str, query: dict[str, Any] | None = None) -> Any:
        try:
            return self.api.request("GET", path, query=query,
                                    timeout=(REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_S))
        except NotFound:
            if what.endswith("s"):
                raise PluginError(f"the API server does not serve {what}; are the Carpool "
                                  f"CRDs installed? (helm install carpool ./helm/carpool)"
                                  ) from None
            return None
        except Forbidden as err:
            raise NotAllowed(f"not allowed to read {what}: {err.message}") from None
        except Unauthorized as err:
            raise PluginError(f"not allowed to read {what}: {err.message}") from None
        except Unreachable as err:
            raise PluginError(f"cannot reach the cluster: {err.message}") from None
        except ApiError as err:
            raise PluginError(f"reading {what}: {err.message}") from None

    def _custom_list(self, resource: Resource, namespace: str | None) -> list[Obj]:
        data = self._call(resource.plural, resource.path(namespace))
        return list(data.get("items") or [])

    def list_gpujobs(self, namespace: str | None) -> list[Obj]:
        return self._custom_list(GPUJOBS, namespace)

    def get_gpujob(self, namespace: str, name: str) -> Obj | None:
        data = self._call("gpujob", GPUJOBS.path(namespace, name))
        return dict(data) if data is not None else None

    def list_quotas(self) -> list[Obj]:
        return self._custom_list(PROJECTQUOTAS, None)

    def list_gpunodes(self) -> list[Obj]:
        return self._custom_list(GPUNODES, None)

    def list_pods(self, namespace: str | None) -> list[Obj]:
        """The pods Carpool's scheduler places (`spec.schedulerName`, which no one can change
        once a pod exists; a label a tenant writes is no such proof): only they can hold
        Carpool GPUs, and a big cluster's other pods are not worth the transfer. Which of
        them hold what is read from their assignments (`reporting.assignments_by_gpu`)."""
        data = self._call("pods", PODS.path(namespace),
                          {"fieldSelector": f"spec.schedulerName={names.SCHEDULER_NAME}"})
        return list(data.get("items") or [])


def connect(kubeconfig: str | None, context: str | None) -> tuple[ClusterReader, str]:
    """A reader for the kubeconfig (or $KUBECONFIG, ~/.kube/config, in-cluster) and the
    namespace its current context names ('default' when none)."""
    from pathlib import Path

    from carpool.kube.client import Api, kubeconfig_namespace  # the kubernetes package: slow

    if kubeconfig and not Path(kubeconfig).is_file():
        raise PluginError(f"no cluster to talk to: kubeconfig {kubeconfig} does not exist")
    try:
        api = Api.load(kubeconfig, context=context, user_agent="kubectl-carpool")
    except ValueError as err:
        raise PluginError(str(err)) from None
    return KubeReader(api), kubeconfig_namespace(kubeconfig, context)


# --- commands -----------------------------------------------------------------------------


def _scope(args: argparse.Namespace, default_all: bool) -> str | None:
    """The namespace to read, None for all: -A wins, then -n, then the command's default."""
    if args.all_namespaces:
        return None
    if args.namespace:
        return str(args.namespace)
    return None if default_all else str(args.context_namespace)


def _scoped_gpujobs(reader: ClusterReader, args: argparse.Namespace) -> list[Obj]:
    """The GpuJobs of the command's scope (all namespaces unless -n); refused for all
    namespaces, as a namespace's user is, the error says how to read one."""
    scope = _scope(args, default_all=True)
    try:
        return reader.list_gpujobs(scope)
    except NotAllowed as err:
        if scope is not None:
            raise
        raise NotAllowed(f"{err} (to read one namespace's: -n NAMESPACE)") from None


def cmd_queue(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    entries = reporting.waiting_jobs(_scoped_gpujobs(reader, args))
    if args.project:
        entries = [e for e in entries if e.project == args.project]
    groups = reporting.queue_groups(entries)
    if args.output == "json":
        return {"groups": groups, "jobs": entries}
    group_table = table(
        ["project", "class", "waiting", "gpus", "head", "next-start", "reasons"],
        [[g.project, g.job_class, g.waiting, g.gpus, g.head_position,
          reporting.relative(epoch_of(g.earliest_start), now),
          ", ".join(f"{r} {n}" if n > 1 else r for r, n in g.reasons.items())]
         for g in groups])
    headers = ["pos", "job", "project", "class", "gpus", "memory", "waiting", "est-start",
               "80%-range", "reason"]
    if args.output == "wide":
        headers.append("message")
    rows = []
    for e in entries:
        job = f"{e.namespace}/{e.name}" + (f" (gang of {e.workers})" if e.workers > 1 else "")
        row: list[object] = [e.position, job, e.project, e.job_class,
                             e.gpus, e.memory,
                             reporting.relative(epoch_of(e.submitted), now)
                             .removesuffix(" ago"),
                             reporting.relative(epoch_of(e.estimated_start), now),
                             reporting.relative_range(e.estimated_range, now) or None,
                             e.reason]
        if args.output == "wide":
            row.append(e.message)
        rows.append(row)
    if not entries:
        return "No GpuJobs are waiting."
    return [group_table, table(headers, rows)]


def cmd_why(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    namespace = args.namespace or args.context_namespace
    name = args.job
    if "/" in name:
        namespace, name = name.split("/", 1)
    job = reader.get_gpujob(namespace, name)
    if job is None:
        raise PluginError(f"GpuJob {name!r} not found in namespace {namespace!r} "
                          f"(kubectl get gpujobs -n {namespace})")
    project = str((job.get("spec") or {}).get("project", ""))
    quota = next((q for q in reader.list_quotas()
                  if (q.get("metadata") or {}).get("name") == project), None)
    phase = (job.get("status") or {}).get("phase") or ""
    waiting = phase in reporting.WAITING_PHASES
    jobs: list[Obj] | None = []
    pods: list[Obj] | None = []
    if waiting:
        try:
            jobs, pods = reader.list_gpujobs(None), reader.list_pods(None)
        except NotAllowed:  # a namespace's user: its job's own status is whole, the rest not
            jobs, pods = None, None
    history = reader.list_gpujobs(namespace) if waiting and jobs is None else []
    explanation = reporting.explain(job, quota, jobs,
                                    reader.list_gpunodes() if waiting else [], pods, now, history)
    if args.output == "json":
        return explanation
    if not explanation.waiting:
        return explanation.summary
    lines = [explanation.summary, ""]
    body = table(["topic", "verdict", "detail"],
                 [[f.topic.value, "BLOCKING" if f.blocking else "ok", f.text]
                  for f in explanation.findings if f.topic is not reporting.Topic.STATUS])
    lines.append(render(body))
    return "\n".join(lines)


def cmd_quota(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    """The quotas' table, then where finished jobs asked for much more GPU memory than they
    used (`core.right_sizing`)."""
    views = reporting.quota_views(reader.list_quotas())
    scope = _scope(args, default_all=True)
    if scope is not None:
        views = [v for v in views if scope in v.namespaces]
    if args.output == "json":
        return views
    if not views:
        return "No ProjectQuotas" + (f" bill namespace {scope}." if scope else " exist.")

    def percent_used(v: reporting.QuotaView) -> str:
        if not v.budget_gpu_hours or v.used_gpu_hours is None:
            return "-"
        return f"{100 * v.used_gpu_hours / v.budget_gpu_hours:.0f}%"

    quotas = table(
        ["project", "budget", "period", "used", "remaining", "used%", "refills", "guaranteed",
         "running", "borrowed", "pending", "mem-eff"],
        [[v.project, reporting.fmt_number(v.budget_gpu_hours), v.period or None,
          reporting.fmt_number(v.used_gpu_hours), reporting.fmt_number(v.remaining_gpu_hours),
          percent_used(v),
          reporting.relative(epoch_of(v.period_end), now) if v.period_end else None,
          reporting.fmt_number(v.guaranteed_gpus) + ("+borrow" if v.borrowing else ""),
          f"{reporting.fmt_number(v.running_gpus)} ({v.running_jobs} jobs)",
          reporting.fmt_number(v.borrowed_gpus), v.pending,
          f"{100 * v.memory_efficiency:.0f}%" if v.memory_efficiency is not None else None]
         for v in views])
    try:
        jobs = reader.list_gpujobs(scope)
    except NotAllowed:  # right-sizing needs the jobs; a user who may not list them sees none
        return quotas
    shown = {v.project for v in views}
    advice = [a for a in reporting.size_advice(jobs) if a.project in shown]
    if not advice:
        return quotas
    sizes = table(
        ["project", "template", "runs", "asks (GiB)", "p90 peak (GiB)", "would do (GiB)"],
        [[a.project, a.template, a.runs, _gib(a.requested_mib), _gib(a.peak_mib),
          _gib(a.recommended_mib)] for a in advice])
    return [quotas, "Right-sizing: finished jobs of these templates used far less GPU memory "
            "than they ask for (per GPU; their 90th-percentile peak + 20 %, in whole GiB):",
            sizes]


def _gib(mib: float | None) -> str:
    return "-" if mib is None else f"{mib / 1024:.1f}"


def cmd_nodes(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    views = reporting.node_views(reader.list_gpunodes(), reader.list_pods(None), now)
    if args.output == "json":
        return views
    if not views:
        return "No GpuNodes (is the Carpool device plugin running on the GPU nodes?)."
    rows = []
    for node in views:
        age = reporting.relative(epoch_of(node.heartbeat), now)
        for i, g in enumerate(node.gpus or ()):
            temp = "-" if g.temperature_c is None else f"{g.temperature_c:.0f}"
            if g.slowdown_temperature_c is not None:
                temp += f"/{g.slowdown_temperature_c:.0f}C"
            health = g.health + (f" ({g.health_reason})" if g.health_reason else "")
            if g.cordoned:
                health += ",cordoned"
            shares = " ".join(
                f"{s.namespace}/{s.pod}("
                + ("whole" if s.exclusive else (s.mig_instance and "mig") or
                   f"{_gib(s.memory_mib)}Gi" + (f",{s.cores_pct}%" if s.cores_pct else ""))
                + ")" for s in g.shares)
            rows.append([node.name if i == 0 else "", node.sharing_mode if i == 0 else "",
                         age if i == 0 else "", g.index, g.model, health, temp,
                         None if g.utilization_pct is None else f"{g.utilization_pct:.0f}%",
                         f"{_gib(g.memory_used_mib)}/{_gib(g.memory_total_mib)}",
                         _gib(g.memory_free_mib), len(g.shares), shares or None])
        if not node.gpus:
            rows.append([node.name, node.sharing_mode, age, None, None, None, None, None,
                         None, None, 0, None])
    return table(["node", "sharing", "heartbeat", "gpu", "model", "health", "temp", "util",
                  "mem-used/total-gib", "free-gib", "pods", "shares"], rows)


def cmd_report(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    try:
        since = reporting.parse_since(args.since, now)
        report = reporting.usage_report(_scoped_gpujobs(reader, args), since, now, by=args.by)
    except ValueError as err:
        raise PluginError(str(err)) from None
    if args.output == "json":
        return report
    first = "project" if args.by == "project" else "job"
    if args.output == "csv":
        by_job = args.by == "job"
        headers = [first] + (["project"] if by_job else []) + ["jobs", "runs", "gpu_hours",
                                                               "share"]
        rows = [[r.key] + ([r.project] if by_job else [])
                + [r.jobs, r.runs, f"{r.gpu_hours:.4f}", f"{r.share:.4f}"] for r in report.rows]
        return render_csv(table(headers, rows))
    rows = [[r.key, r.jobs, r.runs, f"{r.gpu_hours:.2f}", f"{100 * r.share:.1f}%"]
            for r in report.rows]
    rows.append(["TOTAL", sum(r.jobs for r in report.rows), sum(r.runs for r in report.rows),
                 f"{report.total_gpu_hours:.2f}", "100.0%" if report.rows else None])
    header = f"GPU-hours from {report.since} to {report.until}"
    return [header, table([first, "jobs", "runs", "gpu-hours", "share"], rows)]


def cmd_services(reader: ClusterReader, args: argparse.Namespace, now: float) -> Any:
    """Throughput, P99 latency and failure rate of running serving jobs, per job, project,
    class or node (what their code reports through `carpool.workload.Service`)."""
    rows = reporting.service_rows(_scoped_gpujobs(reader, args), by=args.by)
    if args.output == "json":
        return rows
    if not rows:
        return "No running GpuJob reports service measures (see carpool.workload.Service)."
    by_job = args.by == "job"

    def ms(value: float | None) -> str | None:
        return None if value is None else f"{value:.1f}"

    headers = [args.by, "jobs", "req/s", "p99-ms", "failures", "requests"]
    if by_job:
        headers += ["p99-objective", "met", "gpu", "shared-by"]
    body = []
    for r in rows:
        row: list[object] = [r.key, r.jobs, f"{r.throughput:.1f}", ms(r.p99_ms),
                             f"{100 * r.failure_rate:.2f}%", r.requests]
        if by_job:
            met = r.objective_met
            row += [ms(r.p99_objective_ms), None if met is None else ("yes" if met else "NO"),
                    r.gpu_model or None, r.sharing]
        body.append(row)
    return table(headers, body)


COMMANDS: dict[str, Callable[[ClusterReader, argparse.Namespace, float], Any]] = {
    "queue": cmd_queue, "why": cmd_why, "quota": cmd_quota, "nodes": cmd_nodes,
    "report": cmd_report, "services": cmd_services,
}


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, "
                        "~/.kube/config, or in-cluster)")
    common.add_argument("--context", help="kubeconfig context to use")
    common.add_argument("-n", "--namespace", help="namespace (default: the context's)")
    common.add_argument("-A", "--all-namespaces", action="store_true",
                        help="all namespaces")
    parser = argparse.ArgumentParser(
        prog="kubectl carpool",
        description="Carpool's view of the GPU queue, quotas and nodes.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, outputs: Sequence[str]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=help_text)
        p.add_argument("-o", "--output", choices=outputs, default="table")
        return p

    queue = add("queue", "waiting GpuJobs per project and class: positions, estimated "
                "starts, reasons (all namespaces unless -n)", ("table", "wide", "json"))
    queue.add_argument("--project", help="only this project")
    why = add("why", "why a GpuJob waits: quota, budget, capacity, constraints, with numbers",
              ("table", "json"))
    why.add_argument("job", metavar="JOB", help="GpuJob name (or NAMESPACE/NAME)")
    add("quota", "ProjectQuotas: budgets, GPU-hours used and left, running, borrowed, "
        "pending, memory efficiency (-n: those that bill the namespace)", ("table", "json"))
    add("nodes", "GPU nodes: per GPU model, health, temperature, memory, and the pods "
        "sharing it", ("table", "json"))
    report = add("report", "GPU-hours by project (or job) over a window, from the jobs' "
                 "run history", ("table", "csv", "json"))
    report.add_argument("--since", default="7d",
                        help="window start: a duration back from now (7d, 12h) or a date "
                        "(2026-11-01); default 7d")
    report.add_argument("--by", choices=("project", "job"), default="project")
    services = add("services", "serving jobs' throughput, P99 latency and failure rate, per "
                   "job, project, class or node, against their objectives", ("table", "json"))
    services.add_argument("--by", choices=("job", "project", "class", "node"), default="job")
    return parser


def emit(result: Any, output: str, out: TextIO) -> None:
    """Print a command's result: JSON data, a string, a Table, or a list of those."""
    if output == "json":
        out.write(reporting.dumps(result) + "\n")
        return
    parts = result if isinstance(result, list) else [result]
    texts = [render(p) if isinstance(p, Table) else str(p).rstrip("\n") for p in parts]
    out.write("\n\n".join(texts) + "\n")


def main(argv: list[str] | None = None, reader: ClusterReader | None = None,
         now: float | None = None, out: TextIO | None = None) -> int:
    """Entry point; tests pass a canned `reader` and a fixed `now`."""
    args = build_parser().parse_args(argv)
    stdout = out or sys.stdout
    try:
        if reader is None:
            reader, args.context_namespace = connect(args.kubeconfig, args.context)
        elif not hasattr(args, "context_namespace"):
            args.context_namespace = "default"
        result = COMMANDS[args.command](reader, args, time.time() if now is None else now)
    except PluginError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    emit(result, args.output, stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
