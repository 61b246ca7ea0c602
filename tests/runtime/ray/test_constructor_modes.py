"""Where a Ray job builds its batches (RayOptions.constructors): "auto", the default, has the Planner build on
a cluster of one node and a Constructor per node on several (a one-node job on the session's Ray instance:
tests/runtime/ray/test_planner_standby.py::test_the_planner_can_build_in_its_own_process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray")

from plait.errors import PlaitError  # noqa: E402
from plait.runtime.ray import runtime  # noqa: E402


def test_auto_builds_in_the_planner_on_one_live_node_and_per_node_on_several(monkeypatch):
    nodes = [{"Alive": True}, {"Alive": False}]  # a node that died is no node to build on
    monkeypatch.setattr(runtime, "ray_module", lambda: SimpleNamespace(nodes=lambda: nodes))
    assert runtime.RayOptions().constructors == "auto"
    assert runtime.resolve_constructors("auto") == "planner"
    nodes.append({"Alive": True})
    assert runtime.resolve_constructors("auto") == "node"
    assert [runtime.resolve_constructors(m) for m in ("planner", "node", "replica")] == ["planner", "node", "replica"]


def test_an_unknown_mode_is_refused_before_anything_starts():
    with pytest.raises(PlaitError, match="constructors must be one of 'auto', 'planner', 'node', 'replica'"):
        runtime.RayOptions(constructors="gpu")
