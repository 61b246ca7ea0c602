"""Calibrate plait's cost model on a real vision-language model, then measure the balance it buys.

    python examples/calibrate_vlm.py                      # CUDA when present, else CPU (printed)
    python examples/calibrate_vlm.py --quick              # a smoke run (seconds)
    python examples/calibrate_vlm.py --json calib.json    # also write every number as JSON

1. Batches: plait's own micro-batches of the demo's image-text and chat sources (examples/tiny_vlm.py's
   spec), planned and built by the local runtime, at a few `seq_len`s and image weights so that tokens,
   documents and patches vary from one micro-batch to the next.
2. Calibration: forward + backward of examples/tiny_vlm.py's model (a ViT over `pixel_values` feeding a
   GPT; attention varlen by `cu_seqlens` / `image_cu_seqlens`: FlashAttention's varlen kernel on CUDA when
   `flash_attn` imports, else torch SDPA with block-diagonal masks) is timed per micro-batch after a
   warm-up (`torch.cuda.synchronize()` around each timing on CUDA; the best of --repeats). Each row
   (sum_L, sum_L2, count, sum_P, sum_P2, time) goes to a CSV in `plait fit-cost`'s format; the cost model
   is fitted on half of the rows and judged on the other half (relative error of the predicted times).
3. Balance: one global step at DP --dp (simulated ranks, one process) is planned with the fitted costs,
   and the same documents are placed two ways, as in `python -m benchmarks.multimodal`:
     naive  each rank takes its contiguous share of the step's documents in arrival order (a seeded
            interleaving of the sources, as a per-rank loader's mixed stream) and packs them first-fit into
            its micro-batches under both capacities (what does not fit waits for a later step)
     plait  plait's Planner (encoder + LLM cost, token and patch capacities)
   Every simulated rank's micro-batches run through the model back to back (its real step time, the best
   of --repeats, ranks interleaved); the spread max/mean of those times is printed beside the spread the
   cost model predicts for the same placement (fitted model, and the spec's FLOP model the plan used).

On a CPU the times are those of a tiny model on a shared machine: fixed per-call overheads dominate and
timings are noisy. The numbers that matter come from a GPU run (flags size the model and batches).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_gpt import TinyGPT  # noqa: E402
from tiny_vlm import CLIP_MEAN, CLIP_STD, TinyViT, TinyVLM, vlm_example_spec, vlm_loss_sum  # noqa: E402

from plait.cli.fit_cost import COLUMNS, ENCODER_COLUMNS, read_rows  # noqa: E402
from plait.cost import CostModel  # noqa: E402
from plait.packing import IGNORE_INDEX  # noqa: E402
from plait.runtime import make_runtime  # noqa: E402

ROW_COLUMNS = COLUMNS[:3] + ENCODER_COLUMNS + COLUMNS[3:]  # sum_L, sum_L2, count, sum_P, sum_P2, time


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="default: cuda when available, else cpu")
    p.add_argument("--attention", choices=("auto", "flash", "loop", "mask"), default="auto",
                   help="flash: flash-attn's varlen kernel (CUDA); loop: SDPA per document / image (varlen "
                        "by a loop); mask: tiny_vlm's dense block-diagonal masks (full T x T compute, not "
                        "plait's per-document cost); auto: flash on CUDA when importable, else loop")
    p.add_argument("--dim", type=int, default=512 if cuda else 64, help="model width (ViT and GPT)")
    p.add_argument("--layers", type=int, default=4 if cuda else 2, help="layers of the ViT and of the GPT")
    p.add_argument("--heads", type=int, default=8 if cuda else 4)
    p.add_argument("--seq-len", type=int, default=4096 if cuda else 512, help="tokens per micro-batch (balance step)")
    p.add_argument("--calib-seq-lens", default=None,
                   help="seq_lens of the calibration batches (default: seq_len / 4, / 2 and seq_len)")
    p.add_argument("--calib-image-weights", default="0.8,0.3", help="image source weight(s) of the calibration specs")
    p.add_argument("--calib-steps", type=int, default=2, help="planned steps per calibration spec")
    p.add_argument("--dp", type=int, default=4, help="simulated DP ranks")
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--plan-cost", choices=("fit", "spec"), default="fit",
                   help="the cost the balance step is planned with: the fit, or the spec's FLOP model (uncalibrated)")
    p.add_argument("--steps", type=int, default=3, help="global steps compared (naive vs plait)")
    p.add_argument("--repeats", type=int, default=5, help="timings per micro-batch / rank step (the best is kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (the machine may be shared)")
    p.add_argument("--clock", choices=("auto", "wall", "thread"), default="auto",
                   help="thread: CPU time of this thread (CPU, 1 thread: the time other processes take "
                        "from it does not count); wall: elapsed (CUDA always); auto: thread on CPU with "
                        "--threads 1, else wall")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "plait-example-data"))
    p.add_argument("--csv", default=None, help="measured rows here (default: a temporary file); `plait fit-cost CSV`")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: smallest sizes, one step, one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.seq_len, args.calib_steps, args.steps, args.repeats, args.warmup = 256, 1, 1, 1, 1
        args.dp, args.dim, args.layers, args.heads = 2, 32, 1, 2
    if args.calib_seq_lens is None:  # the demo's image documents reach ~200 tokens: 256 at least
        args.calib_seq_lens = ",".join(str(max(256, args.seq_len // d)) for d in (4, 2, 1))
    args.calib_seq_lens = ",".join(map(str, sorted({int(x) for x in args.calib_seq_lens.split(",")})))
    return args


# ----- the model ----------------------------------------------------------------------------------
class DeviceViT(TinyViT):
    """tiny_vlm.TinyViT whose patch positions live on the device of the batch (its own builds them on the CPU)."""

    def positions(self, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = super().positions(grid.cpu())
        return rows.to(grid.device), cols.to(grid.device)


def build_model(image_token_id: int, args: argparse.Namespace, max_len: int) -> TinyVLM:
    """examples/tiny_vlm.py's model, sized by the flags (its ViT and GPT swapped for wider/deeper ones)."""
    torch.manual_seed(args.seed)
    model = TinyVLM(image_token_id, max_len=max_len)
    vocab = model.gpt.tok.num_embeddings
    model.gpt = TinyGPT(vocab=vocab, dim=args.dim, layers=args.layers, heads=args.heads, max_len=max_len)
    model.vit = DeviceViT(dim=args.dim, layers=args.layers, heads=args.heads, out_dim=args.dim)
    return model.to(args.device)


def flash_varlen():
    """flash_attn's varlen kernel, or None when it does not import (signature: q, k, v [T, H, Dh],
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch / CUDA
        return None
    return flash_attn_varlen_func


def sdpa_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
    """The varlen kernel's contract with torch SDPA, one call per sequence: each document's (or image's)
    attention costs its own length squared, as under FlashAttention (a mask over the whole micro-batch
    would cost the micro-batch's length squared)."""
    bounds = cu_q.tolist()
    out = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                          is_causal=causal).transpose(0, 1) for a, b in itertools.pairwise(bounds)]
    return torch.cat(out)


def varlen_block(blk, x, cu, max_len: int, causal: bool, kernel):
    """tiny_gpt.Block's computation with attention from the varlen kernel (no [T, T] mask)."""
    T, D = x.shape
    q, k, v = blk.qkv(blk.ln1(x)).view(T, 3, blk.heads, D // blk.heads).unbind(1)  # [T, H, Dh] each
    a = kernel(q, k, v, cu, cu, max_len, max_len, causal=causal)
    x = x + blk.proj(a.reshape(T, D))
    return x + blk.mlp(blk.ln2(x))


def varlen_loss_sum(model: TinyVLM, batch: dict, kernel) -> torch.Tensor:
    """vlm_loss_sum of tiny_vlm.py with a varlen attention kernel: documents by cu_seqlens (causal), images
    by image_cu_seqlens (bidirectional); the same weights, the same result up to rounding."""
    ids, pos, cu = batch["input_ids"], batch["position_ids"], batch["cu_seqlens"]
    x = model.gpt.tok(ids)
    if batch.get("pixel_values") is not None and len(batch["image_grid"]):
        vit, grid, icu = model.vit, batch["image_grid"], batch["image_cu_seqlens"]
        rows, cols = vit.positions(grid)
        h = vit.embed(batch["pixel_values"]) + vit.row(rows) + vit.col(cols)
        max_patches = int((icu[1:] - icu[:-1]).max())
        for blk in vit.blocks:
            h = varlen_block(blk, h, icu, max_patches, False, kernel)
        h, m, out, start = vit.ln(h), vit.merge, [], 0
        for t, hh, ww in grid.tolist():
            img = h[start : start + t * hh * ww].view(t, hh // m, m, ww // m, m, -1)
            out.append(img.permute(0, 1, 3, 2, 4, 5).reshape(t * (hh // m) * (ww // m), -1))
            start += t * hh * ww
        img = vit.proj(torch.cat(out))
        slots = (ids == model.image_token_id).nonzero(as_tuple=True)[0]
        x = x.index_copy(0, slots, img.to(x.dtype))
    x = x + model.gpt.pos(pos)
    max_doc = int((cu[1:] - cu[:-1]).max())
    for blk in model.gpt.blocks:
        x = varlen_block(blk, x, cu, max_doc, True, kernel)
    logits = model.gpt.head(model.gpt.ln(x))
    return F.cross_entropy(logits.float(), batch["labels"], ignore_index=IGNORE_INDEX, reduction="sum")


class Runner:
    """Forward + backward of one micro-batch (or a rank's list of them) on the chosen device, timed."""

    def __init__(self, model: TinyVLM, device: str, attention: str, clock: str = "wall"):
        self.model, self.device = model, torch.device(device)
        self.cuda = self.device.type == "cuda"
        # On a CPU shared with other processes the wall clock counts their time slices too; with one
        # torch thread forward and backward run on this thread, so its CPU time is the step's compute.
        self.clock = "wall" if self.cuda else clock
        self.now = time.thread_time if self.clock == "thread" else time.perf_counter
        flash = flash_varlen() if self.cuda and attention in ("auto", "flash") else None
        if attention == "flash" and flash is None:
            raise SystemExit("--attention flash: flash_attn does not import here (or no CUDA device)")
        self.kernel = flash or (None if attention == "mask" else sdpa_varlen)  # None: tiny_vlm's masks
        self.attention = self.describe()

    def describe(self) -> str:
        if self.kernel is None:
            return "mask (SDPA, dense block-diagonal masks)"
        return "flash (flash-attn varlen)" if self.kernel is not sdpa_varlen else "loop (SDPA per document/image)"

    def tensors(self, mb) -> dict:
        """The micro-batch on the device; one without images (a text-only micro-batch of an image job)
        loses its empty image fields (to_torch cannot normalise zero patches, and the model takes
        absent pixels as text-only)."""
        if mb.image_grid is not None and not len(mb.image_grid):
            return {k: v for k, v in mb.to_torch(self.device).items() if not k.startswith(("pixel", "image"))}
        return dict(mb.to_torch(self.device, normalize=(CLIP_MEAN, CLIP_STD)))

    def step(self, batch: dict) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda):
            if self.kernel is not None:
                loss = varlen_loss_sum(self.model, batch, self.kernel)
            else:
                loss = vlm_loss_sum(self.model, batch)[0]
        loss.backward()

    def timed(self, batches: list[dict]) -> float:
        """Seconds of forward + backward over these micro-batches, one after the other."""
        self.model.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t = self.now()
        for b in batches:
            self.step(b)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self.now() - t

    def warm_up(self, batches: list[dict]) -> None:
        """Untimed runs (kernels, allocator, autotuning); a flash kernel that fails here falls back to the
        SDPA loop, said aloud (a GPU session should not lose its run to a kernel build mismatch)."""
        try:
            for b in batches:
                self.timed([b])
        except Exception as e:  # reported, then the portable path is used
            if self.kernel in (None, sdpa_varlen):
                raise
            print(f"flash-attn varlen failed ({type(e).__name__}: {e}); using the SDPA loop", flush=True)
            self.kernel = sdpa_varlen
            self.attention = self.describe()
            for b in batches:
                self.timed([b])


# ----- rows for `plait fit-cost` -----------------------------------------------------------------
def features(mb) -> dict:
    """A micro-batch's cost features: tokens, squared document lengths, documents, patches, squared patches
    per image (the encoder's attention is per image)."""
    lengths = np.diff(mb.cu_seqlens).astype(np.float64)
    patches = np.zeros(0) if mb.image_grid is None else mb.image_grid.prod(axis=1).astype(np.float64)
    return {"sum_L": lengths.sum(), "sum_L2": (lengths**2).sum(), "count": float(len(lengths)),
            "sum_P": patches.sum(), "sum_P2": (patches**2).sum()}


def design(rows: list[dict]) -> np.ndarray:
    """The fit's columns in the order of its report: sum_L, sum_L2, count, 1 (overhead), sum_P, sum_P2."""
    return np.asarray([[r["sum_L"], r["sum_L2"], r["count"], 1.0, r["sum_P"], r["sum_P2"]] for r in rows])


def coefficients(report: dict) -> np.ndarray:
    return np.asarray([report[k] for k in ("linear", "quadratic", "per_doc", "overhead",
                                           "encoder_linear", "encoder_quadratic")])


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: f"{r[k]:.9g}" for k in ROW_COLUMNS})


def fit_held_out(path: str, seed: int) -> dict:
    """Fit on a seeded half of the CSV's rows, predict the other half; also the fit on all rows."""
    cols = read_rows(path)  # plait fit-cost's reader: the file is what the CLI accepts
    n = len(cols["time"])
    order = np.random.default_rng(seed).permutation(n)
    train, test = np.sort(order[: (n + 1) // 2]), np.sort(order[(n + 1) // 2 :])

    def fit(sel):
        return CostModel.fit(cols["sum_L"][sel], cols["sum_L2"][sel], cols["count"][sel], cols["time"][sel],
                             sum_P=cols["sum_P"][sel], sum_P2=cols["sum_P2"][sel])

    _, train_report = fit(train)
    _, full_report = fit(np.arange(n))
    rows = [{k: cols[k][i] for k in ROW_COLUMNS} for i in test]
    pred = design(rows) @ coefficients(train_report)
    rel = np.abs(pred - cols["time"][test]) / cols["time"][test]
    return {"rows": n, "train_rows": len(train), "test_rows": len(test), "train_fit": train_report,
            "held_out_rel_err_rms": float(np.sqrt((rel**2).mean())), "held_out_rel_err_max": float(rel.max()),
            "held_out_rel_err_median": float(np.median(rel)), "fit": full_report}


# ----- batches -------------------------------------------------------------------------------------
def example_spec(args: argparse.Namespace, seq_len: int, image_weight: float | None = None, cost: dict | None = None):
    spec = vlm_example_spec(args.data, args.dp, max(args.steps, args.calib_steps), seq_len)
    changes: dict = {"packing": {"microbatches": args.microbatches}, "seed": args.seed}
    if image_weight is not None:
        sources = [s.model_dump(mode="python") for s in spec.sources]
        for s in sources:
            s["weight"] = image_weight if s["name"] == "image" else 1.0 - image_weight
        changes["sources"] = sources
    if cost is not None:
        changes["cost"] = cost
    return spec.with_overrides(**changes)


def place_naive(plan, seed: int, max_patches: int | None):
    """The same documents as plait's plan, placed as per-rank loaders would: a seeded interleaving as the
    arrival stream, each rank's contiguous ~1/R share of its tokens, first-fit into the rank's micro-batches
    under both capacities (benchmarks.multimodal's `naive`, with equal token shares: the step holds
    exactly these documents). Returns a StepPlan of the placed ones and how many had to wait."""
    R, M, C = plan.ranks, plan.microbatches, plan.capacity
    Pc = np.iinfo(np.int64).max if max_patches is None else max_patches
    arrival = np.random.default_rng(seed).permutation(len(plan.items))
    items = plan.items.take(arrival)
    L, P = items.length, items.patches
    share = -(-int(L.sum()) // R)
    rank = np.minimum((np.cumsum(L) - L) // share, R - 1)
    micro = np.full(len(L), -1, dtype=np.int64)
    tok, pat = np.zeros((R, M), dtype=np.int64), np.zeros((R, M), dtype=np.int64)
    for i in range(len(L)):  # a few dozen documents: the Python loop is the baseline's, not plait's
        r = rank[i]
        fit = np.flatnonzero((tok[r] + L[i] <= C) & (pat[r] + P[i] <= Pc))
        if len(fit):
            micro[i] = fit[0]
            tok[r, fit[0]] += L[i]
            pat[r, fit[0]] += P[i]
    keep = np.flatnonzero(micro >= 0)
    cost = plan.cost[arrival][keep]
    naive = dataclasses.replace(
        plan, items=items.take(keep), cost=cost, rank=rank[keep].astype(np.int32), micro=micro[keep].astype(np.int32),
        rank_cost=np.bincount(rank[keep], weights=cost, minlength=R), micro_tokens=tok, rank_microbatches=None)
    return naive, len(L) - len(keep)


def rank_batches(rt, plan) -> list[list]:
    return [rt.build(plan, r) for r in range(plan.ranks)]


# ----- the run --------------------------------------------------------------------------------------
def calibrate(args, runner: Runner) -> tuple[list[dict], dict]:
    """Time plait's micro-batches from specs of several seq_lens and image weights; fit; held-out error."""
    seq_lens = [int(x) for x in args.calib_seq_lens.split(",")]
    weights = [float(x) for x in args.calib_image_weights.split(",")]
    batches = []
    for seq_len in seq_lens:
        for w in weights:
            rt = make_runtime(example_spec(args, seq_len, w), "local")
            try:
                for _ in range(args.calib_steps):
                    plan = rt.plan()
                    naive, _ = place_naive(plan, args.seed + plan.step, rt.spec.packing.max_patches)
                    for placed in (plan, naive):  # plait's full micro-batches and naive's uneven ones
                        batches += [mb for rank in rank_batches(rt, placed) for mb in rank if mb.num_tokens]
                    rt.release()
            finally:
                rt.close()
    tensors = [runner.tensors(mb) for mb in batches]
    runner.warm_up(tensors[: args.warmup])
    best = np.full(len(tensors), np.inf)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.repeats):  # passes in a fresh random order: load drift hits all shapes alike
        for i in rng.permutation(len(tensors)):
            best[i] = min(best[i], runner.timed([tensors[i]]))
    rows = [{**features(mb), "time": float(t), "seq_len": mb.stats["seq_len"]} for mb, t in zip(batches, best)]
    path = args.csv or os.path.join(tempfile.mkdtemp(prefix="plait-calib-"), "rows.csv")
    write_csv(path, rows)
    result = fit_held_out(path, args.seed)
    result["csv"] = path
    return rows, result


def fitted_cost(fit: dict) -> dict | None:
    """The spec's `cost:` section from the fit (None when the fit put everything in overhead/per-doc terms,
    which do not balance)."""
    r = fit["fit"]
    if r["linear"] + r["quadratic"] + r["encoder_linear"] + r["encoder_quadratic"] <= 0:
        return None
    return {"linear": r["linear"], "quadratic": r["quadratic"],
            "encoder": {"linear": r["encoder_linear"], "quadratic": r["encoder_quadratic"]}}


def spread(values) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float(v.max() / v.mean()) if v.mean() > 0 else 1.0


def compare(args, runner: Runner, fit: dict) -> list[dict]:
    """Per step: naive vs plait placements of the same documents, measured and predicted rank times."""
    cost = fitted_cost(fit) if args.plan_cost == "fit" else None
    spec = example_spec(args, args.seq_len, cost=cost)
    coef = coefficients(fit["fit"])
    rt = make_runtime(spec, "local")
    out = []
    try:
        for _ in range(args.steps):
            plan = rt.plan()
            naive, waiting = place_naive(plan, args.seed + 1000 + plan.step, spec.packing.max_patches)
            placed = {"naive": (naive, waiting), "plait": (plan, 0)}
            built = {k: rank_batches(rt, p) for k, (p, _) in placed.items()}
            rt.release()
            tensors = {k: [[runner.tensors(mb) for mb in rank if mb.num_tokens] for rank in ranks]
                       for k, ranks in built.items()}
            best = {k: [float("inf")] * plan.ranks for k in tensors}
            for _ in range(args.repeats):  # ranks and strategies interleaved: drift hits all alike
                for r in range(plan.ranks):
                    for k in tensors:
                        best[k][r] = min(best[k][r], runner.timed(tensors[k][r]))
            for k, (p, wait) in placed.items():
                per_rank_rows = [[features(mb) for mb in rank if mb.num_tokens] for rank in built[k]]
                predicted = [float((design(rows) @ coef).sum()) if rows else 0.0 for rows in per_rank_rows]
                out.append({
                    "step": plan.step, "strategy": k, "documents": len(p.items), "waiting": wait,
                    "tokens": int(p.items.length.sum()), "patches": int(p.items.patches.sum()),
                    "rank_seconds": best[k], "measured_max_over_mean": spread(best[k]),
                    "fitted_rank_seconds": predicted, "fitted_max_over_mean": spread(predicted),
                    "plan_cost_max_over_mean": spread(p.rank_cost),
                    "plan_cost": "fitted" if cost is not None else "spec (FLOPs)",
                })
    finally:
        rt.close()
    return out


def report(args, runner: Runner, calib: dict, rows: list[dict], steps: list[dict], seconds: float) -> dict:
    fit = calib["fit"]
    print(f"\ncalibration: {calib['rows']} micro-batches (seq_len {args.calib_seq_lens}; image weight "
          f"{args.calib_image_weights}), rows in {calib['csv']}  (plait fit-cost {calib['csv']})")
    times = [r["time"] * 1e3 for r in rows]
    print(f"  time per micro-batch {min(times):.1f} .. {max(times):.1f} ms ({runner.clock} clock)")
    names = (("linear", "s/token"), ("quadratic", "s/token^2 (per doc)"), ("per_doc", "s/document"),
             ("overhead", "s/micro-batch"), ("encoder_linear", "s/patch"),
             ("encoder_quadratic", "s/patch^2 (per image)"))
    for k, unit in names:
        print(f"  {k:18s} {fit[k]:.4e}  {unit}")
    print(f"  fit on all rows: r2 {fit['r2']:.4f}, rel. error rms {fit['rel_err_rms']:.1%}, "
          f"max {fit['rel_err_max']:.1%}")
    print(f"  held out (fit on {calib['train_rows']}, predict {calib['test_rows']}): rel. error rms "
          f"{calib['held_out_rel_err_rms']:.1%}, median {calib['held_out_rel_err_median']:.1%}, "
          f"max {calib['held_out_rel_err_max']:.1%}")
    print(f"\nbalance at DP {args.dp} x {args.microbatches} micro-batches of {args.seq_len} tokens "
          f"(planned with the {steps[0]['plan_cost'] if steps else '-'} cost); spread = slowest rank / mean rank")
    print(f"{'step':>4}  {'strategy':8}  {'docs':>4}  {'wait':>4}  {'measured':>8}  {'fitted':>8}  {'plan':>8}  "
          "rank ms")
    for s in steps:
        ms = " ".join(f"{t * 1e3:.0f}" for t in s["rank_seconds"])
        print(f"{s['step']:>4}  {s['strategy']:8}  {s['documents']:>4}  {s['waiting']:>4}  "
              f"{s['measured_max_over_mean']:>8.3f}  {s['fitted_max_over_mean']:>8.3f}  "
              f"{s['plan_cost_max_over_mean']:>8.3f}  {ms}")
    print("measured: real step times of the simulated ranks; fitted: the fitted cost model's prediction of the "
          "same micro-batches; plan: the planner's cost. wait: naive documents that did not fit this step.")
    summary = {s: float(np.mean([x["measured_max_over_mean"] for x in steps if x["strategy"] == s]))
               for s in ("naive", "plait")}
    result = {
        "device": str(runner.device),
        "device_name": torch.cuda.get_device_name(runner.device) if runner.cuda else "cpu",
        "attention": runner.attention, "clock": runner.clock, "torch_threads": torch.get_num_threads(),
        "args": vars(args),
        "calibration": calib, "rows": rows, "steps": steps,
        "mean_measured_max_over_mean": summary, "seconds": seconds, "load_average": os.getloadavg(),
    }
    print(f"mean measured spread: naive {summary['naive']:.3f}, plait {summary['plait']:.3f}  ({seconds:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results written to {args.json}")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    max_len = max([args.seq_len] + [int(x) for x in args.calib_seq_lens.split(",")])
    spec = example_spec(args, args.seq_len)  # generates the demo data once
    model = build_model(spec.images.image_token_id, args, max_len)
    clock = args.clock if args.clock != "auto" else ("thread" if torch.get_num_threads() == 1 else "wall")
    runner = Runner(model, args.device, args.attention, clock)
    name = torch.cuda.get_device_name(runner.device) if runner.cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device: {args.device} ({name}); attention: {runner.attention}; clock: {runner.clock}; "
          f"model dim {args.dim}, {args.layers} layers (ViT and GPT)", flush=True)
    rows, calib = calibrate(args, runner)
    print(f"attention used: {runner.attention}", flush=True)
    steps = compare(args, runner, calib)
    report(args, runner, calib, rows, steps, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
