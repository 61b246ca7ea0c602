"""`benchmarks.per_test_cpu`: the machine's busy CPU moves with work, and the tables rank tests and modules."""

from __future__ import annotations

import json

from benchmarks import per_test_cpu


def test_busy_cpu_grows_with_work():
    before = per_test_cpu.busy_cpu_s()
    sum(i * i for i in range(3_000_000))  # ~0.2 s of one core
    assert per_test_cpu.busy_cpu_s() - before > 0.05


def test_tables_rank_tests_and_modules_by_cpu(tmp_path, capsys):
    rows = [{"id": "tests/a.py::t1", "cpu": 1.0, "wall": 2.0}, {"id": "tests/b.py::t2", "cpu": 5.0, "wall": 1.0},
            {"id": "tests/a.py::t3", "cpu": 3.0, "wall": 1.0}]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert per_test_cpu.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 tests, 9 CPU-s busy in 4 s of wall")
    modules = out.split("module\n")[1].split("\n\n")[0].splitlines()
    assert [m.split()[-1] for m in modules] == ["tests/b.py", "tests/a.py"] and modules[1].split()[0] == "4.0"
    tests = out.split("test\n")[1].splitlines()
    assert [t.split()[-1] for t in tests] == ["tests/b.py::t2", "tests/a.py::t3"]
