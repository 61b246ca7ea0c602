"""`plait fit-cost CSV`: fit the balancing cost model to measured micro-batch times.

Measure a few dozen micro-batches of your model (vary the document lengths: some packed with many short
documents, some with a few long ones), one row each:

    sum_L,sum_L2,count,time
    8192,1048576,64,0.0412
    8192,67108864,1,0.0705

sum_L: tokens in the micro-batch; sum_L2: sum of squared document lengths; count: documents; time:
seconds for forward+backward. The fit (non-negative least squares) gives time ~ linear*sum_L +
quadratic*sum_L2 + per_doc*count + overhead; `linear` and `quadratic` go into the spec's `cost:`.

Multimodal models: add the columns sum_P (image patches in the micro-batch) and sum_P2 (sum of each
image's squared patch count); the fit then also gives the vision encoder's per-image cost
e(P) = encoder_linear*P + encoder_quadratic*P^2 (cost.EncoderCost). Files without them fit as before.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from plait.errors import PlaitError

HELP = "fit the cost model c(L) = a*L + b*L^2 to measured micro-batch times (CSV)"
DESCRIPTION = (
    "Fit the balancing cost model to measured micro-batch times. CSV columns: sum_L (tokens), sum_L2 "
    "(sum of squared document lengths), count (documents), time (seconds); optionally sum_P, sum_P2 (image "
    "patches, squared per-image patches) to fit the vision encoder too. Prints the coefficients, the "
    "fit quality and the `cost:` section to paste into a spec."
)
COLUMNS = ("sum_L", "sum_L2", "count", "time")
ENCODER_COLUMNS = ("sum_P", "sum_P2")  # optional: both or neither


def add_arguments(p) -> None:
    p.add_argument("csv", help="measured rows with columns sum_L, sum_L2, count, time (and optionally sum_P, sum_P2)")
    p.add_argument("--json", metavar="PATH", help="also write the fit as JSON")
    p.add_argument("--tile", type=int, default=0, help="attention tile the kernel pads to (kept in the model)")


def read_rows(path: str) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.exists():
        raise PlaitError(f"no such file: {path}")
    with p.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise PlaitError(f"{path}: missing column(s) {missing}; expected a header with {', '.join(COLUMNS)}")
        have = [c for c in ENCODER_COLUMNS if c in (reader.fieldnames or [])]
        if len(have) == 1:
            raise PlaitError(f"{path}: encoder columns come in pairs: {have[0]} without "
                             f"{next(c for c in ENCODER_COLUMNS if c not in have)}")
        names = COLUMNS + tuple(have)
        cols: dict[str, list[float]] = {c: [] for c in names}
        for line, row in enumerate(reader, start=2):
            try:
                for c in names:
                    cols[c].append(float(row[c]))
            except (TypeError, ValueError):
                raise PlaitError(f"{path}, line {line}: not a number in {row}") from None
    out = {c: np.asarray(v, dtype=np.float64) for c, v in cols.items()}
    if len(out["time"]) < 2:
        raise PlaitError(f"{path}: need at least 2 measured rows (got {len(out['time'])})")
    if (out["time"] < 0).any() or (out["sum_L"] < 0).any() or ("sum_P" in out and (out["sum_P"] < 0).any()):
        raise PlaitError(f"{path}: times, token and patch counts must be >= 0")
    return out


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.cost import CostModel

    rows = read_rows(args.csv)
    model, report = CostModel.fit(rows["sum_L"], rows["sum_L2"], rows["count"], rows["time"], tile=args.tile,
                                  sum_P=rows.get("sum_P"), sum_P2=rows.get("sum_P2"))
    out = Console()
    t = Table(title=f"cost model fitted to {report['rows']} micro-batches of {args.csv}")
    t.add_column("term")
    t.add_column("coefficient", justify="right")
    t.add_column("meaning")
    t.add_row("linear", f"{report['linear']:.4e}", "seconds per token")
    t.add_row("quadratic", f"{report['quadratic']:.4e}", "seconds per token^2 of one document (attention)")
    t.add_row("per_doc", f"{report['per_doc']:.4e}", "seconds per document")
    t.add_row("overhead", f"{report['overhead']:.4e}", "seconds per micro-batch (same for all: not balanced)")
    if model.encoder is not None:
        t.add_row("encoder_linear", f"{report['encoder_linear']:.4e}", "seconds per image patch (vision encoder)")
        t.add_row("encoder_quadratic", f"{report['encoder_quadratic']:.4e}", "seconds per patch^2 of one image")
    out.print(t)
    cross = report["crossover"]
    out.print(
        f"fit: r2 = {report['r2']:.5f}, relative error rms {report['rel_err_rms']:.2%}, max {report['rel_err_max']:.2%}; "
        f"attention equals the rest at L = {cross:,.0f} tokens" if np.isfinite(cross) else
        f"fit: r2 = {report['r2']:.5f}; no measurable attention term (quadratic = 0)"
    )
    snippet = f"cost:\n  linear: {model.linear:.6e}\n  quadratic: {model.quadratic:.6e}\n"
    if args.tile:
        snippet += f"  attention_tile: {args.tile}\n"
    out.print("spec section:\n" + snippet, highlight=False)
    if model.encoder is not None:
        out.print(f"vision encoder: EncoderCost({model.encoder.linear:.6e}, {model.encoder.quadratic:.6e}) "
                  "(CostModel(..., encoder=...) in code)", highlight=False)
    if report["per_doc"] > 0:
        out.print(f"(per_doc is not a spec field yet; CostModel(per_doc={report['per_doc']:.3e}) uses it in code)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
