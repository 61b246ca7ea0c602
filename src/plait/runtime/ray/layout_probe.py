"""The job's loader layout as the Planner actor decides it when it starts: plait.runtime.placement's
decision, with the cost probe run in a throw-away Ray worker process."""

from __future__ import annotations

import logging
import time

from plait.errors import PlaitError
from plait.runtime.placement import LoaderLayout, decide_layout
from plait.runtime.ray.common import get, ray_module
from plait.runtime.scaling import format_layout, probe_costs
from plait.spec import Spec, load_spec

scale_log = logging.getLogger("plait.scaling")
PROBE_TIMEOUT_S = 600.0


def layout_for(spec: Spec, options: dict) -> LoaderLayout:
    """plait.runtime.placement.decide_layout, measuring costs in a throw-away process; logs auto layouts."""
    t0 = time.perf_counter()
    layout = decide_layout(spec, options, probe=probe_elsewhere)
    if options.get("layout") or options["loaders"] != "auto":
        return layout
    scale_log.info("auto layout: %d loader(s) for %d source(s), probed in %.2f s", layout.loaders,
                   len(spec.sources), time.perf_counter() - t0)
    for line in format_layout(layout, spec.source_names):
        scale_log.info("  %s", line)
    return layout


def probe_elsewhere(spec: Spec) -> tuple[list[float], list[int]]:
    """probe_costs in a one-off Ray worker process that exits afterwards: what reading and decoding the
    probe's blocks leaves behind (allocator pages, file-system and footer caches: ~60 MiB for 64
    sources) goes with it instead of staying in the Planner for the whole job."""
    ray = ray_module()
    task = ray.remote(num_cpus=0, max_calls=1)(probe_task)
    try:
        return get(task.remote(spec.model_dump(mode="json")), timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise PlaitError(f"the cost probe (each source's first blocks) took over {PROBE_TIMEOUT_S:.0f} s: is the "
                         "storage reachable? Pass loaders=N to skip the probe") from None


def probe_task(spec_dict: dict) -> tuple[list[float], list[int]]:
    return probe_costs(load_spec(spec_dict))
