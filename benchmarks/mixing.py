"""`python -m benchmarks.mixing`: how closely the achieved mixture follows its target, and exact resumes.

On three small pre-tokenized sources written to a temp dir, it plans (metadata only) a run for each
schedule kind (constant, step, linear, cosine, by tokens, source windows), one with a run-time
`set_weights`, one with the online exp-gradient policy (synthetic losses), and a resume with an added
source. For each: the worst absolute error of any source's achieved token share over windows of 100
steps (target <= 0.01), and, for runs interrupted and resumed from their data state, whether the
resumed steps' digests equal the uninterrupted run's (for the added source: whether the unchanged
sources continue their order exactly, by sample ids).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import main, write_result

HELP = "achieved mixture vs target per 100-step window, for each schedule kind and run-time change; exact resume"
DESCRIPTION = __doc__

SCHEDULES = {
    "constant": {},
    "step": {"interpolation": "step", "schedule": [{"step": 0, "weights": {"a": 1, "b": 1}},
                                                   {"step": 150, "weights": {"b": 1, "c": 3}}]},
    "linear": {"schedule": [{"step": 0, "weights": {"a": 0.8, "b": 0.1, "c": 0.1}},
                            {"step": 300, "weights": {"a": 0.1, "c": 0.9}}]},
    "cosine": {"interpolation": "cosine", "schedule": [{"step": 0, "weights": {"a": 0.7, "b": 0.3}},
                                                       {"step": 300, "weights": {"b": 0.2, "c": 0.8}}]},
    "tokens": {"schedule_by": "tokens", "schedule": [{"tokens": 0, "weights": {"a": 1}},
                                                     {"tokens": 600_000, "weights": {"b": 1, "c": 1}}]},
}


def add_arguments(p) -> None:
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--json", metavar="PATH")


def _write_sources(root: Path) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for k, (name, hi) in enumerate((("a", 300), ("b", 1500), ("c", 700))):
        rng = np.random.default_rng(k)
        (root / name).mkdir()
        for f in range(2):
            lengths = rng.integers(1, hi, size=4000)
            flat = rng.integers(0, 30000, size=int(lengths.sum())).astype(np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            col = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
            pq.write_table(pa.table({"input_ids": col}), str(root / name / f"{f}.parquet"), row_group_size=500)
        out.append({"name": name, "path": str(root / name / "*.parquet"), "tokens_field": "input_ids"})
    return out


def _plan(spec, steps: int, *, state=None, hook=None, allow=False):
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    try:
        if state is not None:
            rt.load_state_dict(state, allow_spec_change=allow)
        drawn, weights, digests, ids = [], [], [], []
        for _ in range(steps):
            if hook is not None:
                hook(rt)
            plan = rt.plan()
            rt.release()
            it = plan.items
            cols = np.stack([it.source, it.epoch, it.fpos, it.bpos, it.position, it.chunk, plan.rank, plan.micro], 1)
            digests.append(hashlib.sha256(cols.astype(np.int64).tobytes()).hexdigest())
            ids.extend(map(tuple, cols[:, :6].tolist()))
            drawn.append(plan.drawn)
            weights.append(plan.weights)
        return np.array(drawn), np.array(weights), digests, ids, rt.state_dict()
    finally:
        rt.close()


def _worst(drawn, weights) -> float:
    from plait.mixture import share_windows

    return max(w["worst_error"] for w in share_windows(drawn, weights, 100))


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.spec import load_spec

    steps, cut = args.steps, args.steps // 2 + 7
    rows = {}
    with tempfile.TemporaryDirectory(prefix="plait-bench-mixing-") as tmp:
        sources = _write_sources(Path(tmp))

        def spec_of(mixture=None, srcs=None):
            return load_spec({"sources": srcs or sources, "mixture": mixture or {}, "seed": 1,
                              "packing": {"seq_len": args.seq_len, "microbatches": 4}, "topology": {"dp": 2}})

        def resumed(spec, hook=None):
            full = _plan(spec, steps, hook=hook)
            head = _plan(spec, cut, hook=hook)
            tail = _plan(spec, steps - cut, state=json.loads(json.dumps(head[4])), hook=hook)
            return {"worst_window_error": _worst(full[0], full[1]), "resume_exact": head[2] + tail[2] == full[2]}

        for kind, mixture in SCHEDULES.items():
            rows[f"schedule: {kind}"] = resumed(spec_of(mixture))
        windowed = [sources[0], {**sources[1], "start_step": 100}, {**sources[2], "stop_step": 250}]
        rows["schedule: source windows"] = resumed(spec_of(srcs=windowed))

        def set_weights(rt):
            if rt.planner.step == 50:
                rt.set_weights({"a": 0.6, "c": 0.1}, at_step=120)

        rows["run-time set_weights"] = resumed(spec_of(), set_weights)
        online = {"online": {"every": 50, "lr": 2.0, "floor": 0.1, "delay": 4}}

        def report(rt):
            s = rt.planner.step - 2
            if s >= 0:
                rt.report(s, {"a": 2.0 + 0.002 * s, "b": 3.0 - 0.003 * s, "c": 2.6})

        rows["online exp_gradient"] = resumed(spec_of(online), report)
        two, three = spec_of(srcs=sources[:2]), spec_of(srcs=sources)
        full = _plan(two, steps)
        head = _plan(two, cut)
        tail = _plan(three, steps - cut, state=json.loads(json.dumps(head[4])), allow=True)
        exact = True
        for s in (0, 1):
            got = sorted(x for x in head[3] + tail[3] if x[0] == s)
            want = sorted(x for x in full[3] if x[0] == s)
            k = min(len(got), len(want)) - 64
            exact &= len(set(got)) == len(got) and got[:k] == want[:k]
        rows["resume with an added source"] = {"worst_window_error": _worst(tail[0], tail[1]), "resume_exact": exact}
    table = Table(title=f"mixing: {steps} steps, worst |achieved - target| share over 100-step windows")
    for col in ("case", "worst window error", "resume exact"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for case, r in rows.items():
        table.add_row(case, f"{r['worst_window_error']:.4f}", "yes" if r["resume_exact"] else "NO")
    Console().print(table)
    if args.json:
        write_result(args.json, {"steps": steps, "cut": cut, "cases": rows})
    return 0 if all(r["resume_exact"] and r["worst_window_error"] <= 0.01 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
