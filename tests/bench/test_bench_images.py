"""`plait bench images`: the loader decodes each delivered image exactly once and never while planning."""

from __future__ import annotations

import json

import pytest

from plait.cli import main


def test_bench_images_decodes_once_per_delivered_image(tmp_path):
    out = tmp_path / "images.json"
    rc = main(["bench", "images", "--images", "40", "--steps", "2", "--dp", "8", "--seq-len", "2048",
               "--max-side", "320", "--rounds", "1", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["delivered_images"] > 0
    assert r["planning_decodes"] == 0
    assert r["decodes_local"] == r["delivered_images"]
    assert r["decodes_per_image_local"] == 1.0
    assert r["loader_images_per_cpu_s"] > 0 and r["pillow_images_per_s"] > 0


def test_bench_images_ratio_is_wall_against_wall_over_the_workers(tmp_path):
    out = tmp_path / "images.json"
    rc = main(["bench", "images", "--images", "24", "--steps", "1", "--dp", "2", "--seq-len", "2048",
               "--max-side", "256", "--rounds", "1", "--workers", "2", "--quiet", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["workers"] == 2
    # loader images per wall second over (N x one core's Pillow images per wall second), both of this run
    assert r["ratio_wall"] == pytest.approx(r["loader_images_per_s_wall"] / (2 * r["pillow_images_per_s"]))
    assert r["ratio_cpu"] == pytest.approx(r["loader_images_per_cpu_s"] / r["pillow_images_per_cpu_s"])
    assert len(r["loadavg"]) == 6  # the machine's load at the start and the end
