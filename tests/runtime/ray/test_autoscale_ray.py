"""Re-partitioning SourceLoaders while a ray job runs (issue 12's mechanism): the stream never changes.

A job starts with one loader; mid-run `rescale` splits the `short` source into 3 partitions over 3 new
loaders, later merges to 2: the digest (tokens, labels, positions, sample ids) equals the local runtime's
and every sample id is delivered exactly once. A shadowed source is re-partitioned, then a loader of the new
layout is killed: its shadow (started for the new layout) takes over. `scaling_report` records the events;
with `autoscale` on, the control loop records its timeline. One local Ray instance serves the module.
"""

from __future__ import annotations

import hashlib
import time

import pytest

ray = pytest.importorskip("ray")

from fixtures import compare_streams, mixed_spec as make_spec  # noqa: E402
from plait.cli.common import console  # noqa: E402
from plait.cli.top import scrape  # noqa: E402
from plait.errors import PlaitError  # noqa: E402
from plait.metrics import batch_digest_update  # noqa: E402
from plait.runtime.local import LocalRuntime  # noqa: E402
from plait.runtime.placement import LoaderLayout, deal  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
STEPS = 12
DP = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("autoscale")


def drive(rt, on_step=None) -> tuple[list, str]:
    """Every rank's micro-batches of STEPS steps: (sample id arrays in order, digest)."""
    ids, h = [], hashlib.sha256()
    for step in range(STEPS):
        plan = rt.plan()
        if on_step is not None:
            on_step(step)
        for r in range(plan.ranks):
            for mb in rt.build(plan, r):
                ids.append(mb.sample_ids)
                batch_digest_update(h, mb)
        rt.release()
    return ids, h.hexdigest()


@pytest.fixture(scope="module")
def reference(data):
    rt = LocalRuntime(make_spec(data, dp=DP))
    try:
        return drive(rt)
    finally:
        rt.close()


def layout(partitions: dict[int, int], loaders: int) -> LoaderLayout:
    """`short` (source 0) and the others split as given, dealt over `loaders` (equal weights)."""
    return LoaderLayout(partitions, [sorted(o) for o in deal(partitions, [1.0, 1.0, 1.0], loaders)])


THREE = layout({0: 3, 1: 1, 2: 1}, 3)  # 1 loader -> 3: `short` split into 3 partitions
TWO = layout({0: 2, 1: 2, 2: 1}, 2)  # then back to 2 loaders, other partitions


def test_rescaling_mid_run_keeps_the_stream(ray_session, data, reference):
    from plait.runtime.ray import RayRuntime

    rt = RayRuntime(make_spec(data, dp=DP, metrics={"port": 0}), loaders=1)
    versions = []
    try:
        def on_step(step):
            if step == 3:
                versions.append(rt.rescale(THREE, "test: split"))
                assert len(ray.get(rt.planner.get_loaders.remote())) == 3
            if step == 7:
                versions.append(rt.rescale(TWO.to_dict(), "test: merge"))

        ids, digest = drive(rt, on_step)
        stats = rt.stats()
        report = rt.scaling_report()
        metrics = scrape([rt.metrics_address()]).values
    finally:
        rt.close()
    ref_ids, ref_digest = reference
    assert digest == ref_digest
    assert compare_streams(ref_ids, ids) == {"delivered": sum(map(len, ref_ids)), "lost": 0, "duplicated": 0,
                                             "same_order": True}
    assert versions == [1, 2] and stats["routing_version"] == 2
    # The Constructors built the last steps with the newest routing, and its loaders did the reading.
    assert {c["routing_version"] for c in stats["constructors"].values()} == {2}
    assert len(stats["loaders"]) == 2 and all(ld["blocks_read"] > 0 for ld in stats["loaders"])
    # Every build handed out under v0 / v1 finished: their loaders were retired, not left running.
    assert stats["retiring"] == []
    # (c) the report: one event per rescale, with the new layout's shape.
    events = report["events"]
    assert [e["kind"] for e in events] == ["manual", "manual"]
    assert [e["reason"] for e in events] == ["test: split", "test: merge"]
    assert [e["loaders"] for e in events] == [3, 2]
    assert events[0]["partitions"] == {"short": 3, "mid": 1, "long": 1}
    assert events[1]["partitions"] == {"short": 2, "mid": 2, "long": 1}
    assert [round(sum(e["loaders_per_source"].values())) for e in events] == [3, 2]
    assert events[0]["step"] <= events[1]["step"] and events[0]["t"] <= events[1]["t"]
    assert report["initial"]["loaders"] == 1 and report["options"] is None and report["timeline"] == []
    # The job's /metrics: rescales by kind, loaders per source (the last layout), demand not reported unmet.
    assert metrics[("plait_rescale_events_total", (("kind", "manual"),))] == 2
    for name, n in events[1]["loaders_per_source"].items():
        assert metrics[("plait_source_loaders", (("source", name),))] == pytest.approx(n)
    assert metrics[("plait_loader_demand_unmet", ())] == 0
    # `plait run` shows them (a table of events) and plots the report.
    from plait.cli.run import plot_scaling, print_scaling

    with console.capture() as shown:
        print_scaling(report)
    assert "test: split" in shown.get() and "test: merge" in shown.get()
    plot_scaling(report, str(data / "scaling.png"))
    assert (data / "scaling.png").stat().st_size > 0


def test_a_shadowed_source_rescaled_then_a_new_loader_killed(ray_session, data, reference):
    from plait.runtime.ray import RayRuntime

    rt = RayRuntime(make_spec(data, dp=DP, shadows=1), loaders=2)
    try:
        old = ray.get(rt.planner.get_loaders.remote())
        old_shadows = [sh for group in ray.get(rt.planner.get_shadows.remote()) for sh in group]

        def on_step(step):
            if step == 2:
                rt.rescale(THREE)
            if step == 6:  # a loader started for the new layout dies: the shadow started for it takes over
                started = [h for h in ray.get(rt.planner.get_loaders.remote()) if h not in old]  # (not handed over)
                ray.kill(started[0], no_restart=True)

        ids, digest = drive(rt, on_step)
        kept = set(ray.get(rt.planner.get_loaders.remote())) & set(old)  # handed over: same partitions
        kept_shadows = {sh for group in ray.get(rt.planner.get_shadows.remote()) for sh in group} & set(old_shadows)
        shadows = ray.get(rt.planner.get_shadows.remote())
        events = rt.recovery_events()
        stats = rt.stats()
    finally:
        rt.close()
    assert digest == reference[1]
    assert compare_streams(reference[0], ids)["same_order"]
    loader_events = [e for e in events if e["role"] == "loader"]
    assert len(loader_events) == 1 and loader_events[0]["how"].startswith("shadow promoted"), events
    assert "@v1" in loader_events[0]["actor"]  # the dead one was of the new layout
    assert len(shadows) == 3  # one standby group per loader of the new layout
    assert stats["retiring"] == []
    assert len(kept) < len(old)
    for handle in [h for h in old + old_shadows if h not in kept and h not in kept_shadows]:  # the others ended
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.stats.remote() if handle in old else handle.shadow_stats.remote(), timeout=30)


def test_a_bad_layout_is_refused_and_nothing_changes(ray_session, data):
    from plait.runtime.ray import RayRuntime

    rt = RayRuntime(make_spec(data, dp=DP), loaders=1)
    try:
        with pytest.raises(PlaitError, match="exactly once"):
            rt.rescale(LoaderLayout({0: 2, 1: 1, 2: 1}, [[(0, 0), (1, 0)], [(2, 0)]]))
        assert rt.stats()["routing_version"] == 0 and rt.scaling_report()["events"] == []
    finally:
        rt.close()


def test_autoscale_loop_records_a_timeline_and_keeps_the_stream(ray_session, data, reference):
    import plait

    spec = make_spec(data, dp=DP)
    assert plait.Loader(spec, dp_rank=0, steps=1).scaling_report() == {"events": [], "timeline": [],
                                                                        "options": None}
    from plait.runtime.ray import RayRuntime

    rt = RayRuntime(spec, loaders=1, autoscale={"interval_s": 0.2, "cooldown_s": 0.4, "patience": 1})
    try:
        ids, digest = drive(rt)
        deadline = time.monotonic() + 60  # the loop samples every 0.2 s: wait until it saw every step consumed

        def consumed():
            return sum(r["steps"] for r in rt.scaling_report()["timeline"])

        while consumed() < STEPS and time.monotonic() < deadline:
            time.sleep(0.1)
        report = rt.scaling_report()
    finally:
        rt.close()
    assert digest == reference[1]
    assert report["options"]["interval_s"] == 0.2
    row = report["timeline"][0]
    assert set(row) == {"t", "step", "loaders", "loaders_per_source", "wait_s", "steps", "busy"}
    assert row["loaders"] == len(row["busy"]) >= 1
    # The trainers' consumption, summed over the intervals: every step each rank asked for, once.
    assert sum(r["steps"] for r in report["timeline"]) == STEPS
    for e in report["events"]:  # whatever the controller decided is recorded with its layout
        assert e["kind"] in ("up", "down", "unmet") and e["reason"]


def test_plait_run_autoscale_writes_the_report_and_plot(ray_session, data, tmp_path, capsys):
    import json

    import yaml

    from plait import cli

    make_spec(data, dp=DP)  # writes the data once
    spec = {"seed": 7, "packing": {"seq_len": 256, "microbatches": 2}, "topology": {"dp": DP},
            "sources": [{"name": n, "path": str(data / n / "*.parquet"), "tokens_field": "input_ids", "eos": 1,
                         "weight": 1.0} for n in ("short", "mid", "long")]}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out, png = tmp_path / "s.json", tmp_path / "scaling.png"
    assert cli.main(["run", str(path), "--runtime", "ray", "--loaders", "1", "--autoscale", "--autoscale-interval",
                     "0.2", "--steps", "6", "--quiet", "--json", str(out), "--plot", str(png)]) == 0
    scaling = json.loads(out.read_text())["scaling"]
    assert scaling["options"]["interval_s"] == 0.2 and scaling["initial"]["loaders"] == 1
    assert png.stat().st_size > 0
    # A user mistake is a clear message, no traceback.
    assert cli.main(["run", str(path), "--quiet", "--autoscale"]) == 2
    assert "--runtime ray" in capsys.readouterr().err
    assert cli.main(["run", str(path), "--quiet", "--runtime", "ray", "--autoscale-interval", "1"]) == 2
    assert "need --autoscale" in capsys.readouterr().err
    assert cli.main(["run", str(path), "--quiet", "--runtime", "ray", "--autoscale", "--autoscale-interval", "0"]) == 2
    assert "interval_s" in capsys.readouterr().err


def test_error_reports_of_retired_and_current_loaders_count_each_bad_record_once():
    """After a rescale the new owner decodes a block again and meets its bad records again: the job's
    report counts each once per epoch (by file, record and epoch), and keeps what retired loaders found."""
    from plait.runtime.ray.planner_actor import merge_error_reports

    retired = {"a": {"skipped": 2, "messages": ["a/0: bad", "a/1: bad"], "records": [["f0", "0", 0], ["f0", "1", 0]]}}
    current = [{"a": {"skipped": 3, "messages": ["a/1: bad", "a/7: bad"],
                      "records": [["f0", "1", 0], ["f0", "1", 1], ["f1", "7", 1]]}},
               {"b": {"skipped": 0, "messages": [], "records": []}}]
    merged = merge_error_reports(current + [retired])
    assert merged == {"a": {"skipped": 4, "bad_records": 3, "messages": ["a/1: bad", "a/7: bad", "a/0: bad"]},
                      "b": {"skipped": 0, "bad_records": 0, "messages": []}}
