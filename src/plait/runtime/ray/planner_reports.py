"""What the Planner actor reports about the whole job: the records its loaders skipped and the memory
its actors use (`plait jobs`). Both gather from many actors; neither is on the planning path."""

from __future__ import annotations

from plait.runtime.ray.common import NAMESPACE, process_rss, ray_module
from plait.sources.bad_records import merge_reports as merge_error_reports  # the one rule (bad_records.py)
from plait.runtime.ray.planner_requests import planner_call

MEMORY_TIMEOUT_S = 10  # an actor that does not answer by then is left out (counted as asked, not answered)


def job_memory(handles: list, constructor_names: list[str]) -> dict:
    """Resident memory of this process and of the job's actors (`handles`, and the Constructors found by
    name; each measures itself), in bytes, and how many answered."""
    ray = ray_module()
    handles = list(handles)
    for name in constructor_names:
        try:
            handles.append(ray.get_actor(name, namespace=NAMESPACE))
        except ValueError:
            pass
    total, actors = process_rss(), 1
    refs = [h.stats.remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=MEMORY_TIMEOUT_S)
    for ref in ready:
        try:
            total += int(ray.get(ref).get("rss", 0))
            actors += 1
        except Exception:  # noqa: BLE001 - a dead actor adds nothing
            pass
    return {"rss": total, "actors": actors, "actors_asked": len(handles) + 1}


class ReportRequests:
    """The Planner actor's reports: skipped records, the loaders' and shadows' figures, recoveries, the
    job's metrics endpoint (a part of plait.runtime.ray.planner_actor's PlannerActor, which holds
    `loaders`, `routes`, `metrics`, `lock` and `observers`)."""

    @planner_call()
    def error_report(self) -> dict:
        """Records skipped, over the current loaders and those of retired layouts, per sample per epoch; a
        bad record that several loaders met in one epoch (a block decoded again after a replacement or a
        rescale) counts once."""
        reports = self.loaders.each("error_report") + [
            rep for routing in self.routes.retired for rep in routing.fleet.final_errors]
        return merge_error_reports(reports)

    @planner_call()
    def loader_stats(self) -> list[dict]:
        return self.loaders.each("stats")

    @planner_call()
    def recovery_events(self) -> list[dict]:
        return list(self.loaders.events)

    # ----- metrics (plait.runtime.ray.job_metrics) --------------------------------------------------
    def metrics_address(self) -> str | None:
        """`host:port` of the job's /metrics endpoint; None when the spec sets no metrics port."""
        return self.metrics.address

    @planner_call()
    def record_recovery(self, role: str) -> None:
        """A trainer process recovered from a failure of `role` (planner, constructor): count it."""
        self.metrics.telemetry.observe_recovery(role)

    def _observe_event(self, event: dict) -> None:
        if event["role"] in ("loader", "shadow"):  # failures (not "shadow-start", a standby starting)
            self.metrics.telemetry.observe_recovery(event["role"])

    @planner_call()
    def get_shadows(self) -> list[list]:
        return self.loaders.shadows

    @planner_call()
    def shadow_stats(self) -> list[list[dict]]:
        return self.loaders.shadow_stats()
