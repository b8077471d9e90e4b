"""Multi-request serving with chunked prefill: requests arrive on a real clock, a policy packs
decode tokens and prefill chunks into each engine step, one packed forward runs them all.

    from engine.serving import ServeConfig, Policy, load_workload, run_serve, report
    result = run_serve(load_model("embedded"), load_workload("doc-arrives"),
                       ServeConfig(policy=Policy.DECODE_FIRST, chunk_size=64))
    report(result)["summary"]["by_class"]["short"]["itl_ms_p99"]

Modules: workload (workloads as data), scheduler (policies), packed (the packed forward),
loop (the engine steps), prefix_cache (reusing the KV blocks of shared prompt prefixes;
ServeConfig(prefix_cache=True)), routing (a simulation of several replicas with their own
caches), records, report (metrics and the JSON), cli.
"""

from engine.serving.loop import ServeConfig, ServeResult, run_serve, serve
from engine.serving.records import ItemKind, RequestClass, RequestRecord, ServeStep, StepItem
from engine.serving.report import report, summary
from engine.serving.scheduler import Policy
from engine.serving.workload import Workload, WorkloadRequest, builtin_workloads, load_workload, parse_workload

__all__ = [
    "ItemKind", "Policy", "RequestClass", "RequestRecord", "ServeConfig", "ServeResult", "ServeStep", "StepItem",
    "Workload", "WorkloadRequest", "builtin_workloads", "load_workload", "parse_workload", "report", "run_serve",
    "serve", "summary",
]
