"""Every `plait bench` command and every benchmark that moved out of it to benchmarks/ answers --help with its
options and measures nothing (no temp files, no Ray)."""

from __future__ import annotations

import importlib

import pytest

from plait.cli import BENCH_MODULES, main

MOVED = ("balance", "throughput", "e2e", "video_resize", "images_ray", "memory")  # python -m benchmarks.NAME


@pytest.mark.parametrize("name", sorted(BENCH_MODULES))
def test_plait_bench_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0 and "--json" in capsys.readouterr().out


@pytest.mark.parametrize("name", MOVED)
def test_benchmarks_help(name, capsys):
    from benchmarks.common import main as bench_main

    with pytest.raises(SystemExit) as e:
        bench_main(importlib.import_module(f"benchmarks.{name}"), ["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and f"python -m benchmarks.{name}" in out and "--json" in out
