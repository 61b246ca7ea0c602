"""`python -m benchmarks.multimodal`: step-time balance of image + text steps, with two capacities.

A multimodal sample costs the vision encoder over its images' patches plus the language model over its
tokens (image placeholders included: patches / 4 tokens per image), and a micro-batch holds at most
`seq_len` tokens and `max_patches` patches (the encoder's memory). For each workload and DP size it draws
one global step (samples filling dp x microbatches x seq_len tokens) and places it three ways:

  naive     each DP rank packs its contiguous share of the stream, in order, first-fit into its
            micro-batches (both capacities): what per-rank loaders do
  llm-only  balance.assign with both capacities but costs of the language model alone (a text
            balancer that ignores the encoder), measured under the true total cost
  plait     balance.assign with the total cost (encoder + language model) and both capacities

Per strategy: max/LB of the per-rank total cost (LB: balance.capacity_lower_bound of the placed items,
the capacity-aware bound), max/mean, token fill, and plait's planning time (CPU ms of the planning
thread, kernels compiled beforehand).

Workloads: `caption` (one image of 256-16k patches, dynamic resolution, and a short caption), `interleaved`
(documents of 2-8 images and long text), `hires` (captions with high-resolution images, 30% text-only),
`video` (60% samples with one clip of 2 s to 10 min, 640x360, under the Qwen2-VL rule with its defaults,
20% with an image, the rest text; a video of grid (t, h, w) enters as t encoder sequences of h*w patches,
as Qwen2-VL's vision tower attends per temporal patch: its cost grows with t*h*w).

Audio workloads (issue 42), each under both window policies (`--audio-policies`) on the same samples:
`audio-text` (85% samples with one speech clip and a short text, the rest text documents), `audio-images`
(50% clips, 25% images), `audio-video` (40% clips, 20% images, 20% videos as in `video`). Clips last
1-30 s (median 5 s), one in ten 30 s-2 min; plait's AudioPolicy plans them (25 placeholder tokens a
second) and the audio encoder (Whisper-large-v3's dimensions) costs every padded 30 s window under
`qwen2audio`, chunks of 2 s growing with the duration under `chunked`. Audio takes no patch capacity;
with `--max-audio-spans N` it takes a capacity of its own: the balancer gets two encoder capacities
(patches, and the audio encoder's attention positions: 1,500 per padded window under `qwen2audio`), N of
them per micro-batch (the audio encoder's memory), as a vector (`balance.assign(loads=[n, 2])`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from benchmarks.common import main

HELP = "balance of image + text steps (encoder + LLM cost, token and patch capacities): naive, llm-only, plait"
DESCRIPTION = (
    "Draw one global step of multimodal samples per (workload, DP size) and place it three ways: naive "
    "(per-rank first-fit in stream order), llm-only (plait's balancer with costs of the language model "
    "only) and plait (encoder + LLM cost, token and patch capacities). Reports max/LB against the "
    "capacity-aware lower bound of the total cost, max/mean, token fill and planning time."
)

WORKLOADS = ("caption", "interleaved", "hires", "video", "audio-text", "audio-images", "audio-video")
DPS = (8, 64, 512)
STRATEGIES = ("naive", "llm-only", "plait")
PATCHES_PER_TOKEN = 4  # an image of P patches takes P / 4 placeholder tokens (2x2 merge)


def add_arguments(p) -> None:
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"default {','.join(WORKLOADS)}")
    p.add_argument("--dp", default=",".join(map(str, DPS)), help=f"DP sizes (default {','.join(map(str, DPS))})")
    p.add_argument("--audio-policies", default=",".join(AUDIO_POLICIES),
                   help="window policies the audio workloads run under (default qwen2audio,chunked)")
    p.add_argument("--seq-len", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--max-patches", type=int, default=32768, help="image patches per micro-batch (encoder memory)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank per step")
    p.add_argument("--max-audio-spans", type=int, default=None,
                   help="audio encoder positions per micro-batch: a second encoder capacity (default: none)")
    p.add_argument("--encoder", default="6b", choices=("6b", "300m"),
                   help="vision tower: 6b (InternViT-6B-like: the encoder dominates) or 300m (ViT-L-like)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="plan_ms is the best of this many plannings")
    p.add_argument("--json", metavar="PATH", help="write one row per (workload, dp, strategy)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def cost_models(encoder: str):
    """The language model (7B Llama-like) and the vision tower."""
    from plait.cost import CostModel, EncoderCost

    vit = EncoderCost.from_dims(3200, 45, 12800) if encoder == "6b" else EncoderCost.from_dims(1024, 24, 4096)
    return CostModel.from_dims(4096, 32, 11008, 32), vit


# ----- samples ---------------------------------------------------------------------------------
def sample_step(workload: str, budget: int, seq_len: int, max_patches: int, rng: np.random.Generator,
                audio_policy: str | None = None):
    """Samples of one step in stream order, until `budget` tokens: (tokens, patches per image, CSR
    offsets of each sample's images, audio encoder cost, audio encoder positions). A sample's tokens
    include its images' and clips' placeholders."""
    toks, pats, counts, total, extra = [], [], [], 0, []
    while total < budget:
        n = 4096
        if workload in AUDIO_MIXES:
            for L, p, clip in zip(*audio_samples(rng, n, seq_len, max_patches, workload, audio_policy)):
                toks.append(L)
                pats.append(p)
                counts.append(len(p))
                extra.append(clip)
                total += L
                if total >= budget:
                    break
            continue
        if workload == "caption":
            k = np.ones(n, dtype=np.int64)
            text = np.clip(rng.lognormal(np.log(60), 0.7, n), 8, 1000).astype(np.int64)
        elif workload == "interleaved":
            k = rng.integers(2, 9, n)
            text = np.clip(rng.lognormal(np.log(2500), 0.8, n), 64, seq_len).astype(np.int64)
        elif workload == "video":
            toks_v, pats_v, counts_v = video_samples(rng, n, seq_len, max_patches)
            for L, p in zip(toks_v, pats_v):
                toks.append(L)
                pats.append(p)
                counts.append(len(p))
                total += L
                if total >= budget:
                    break
            continue
        elif workload == "hires":
            k = (rng.random(n) < 0.7).astype(np.int64)
            text = np.where(k > 0, np.clip(rng.lognormal(np.log(120), 0.8, n), 8, 2000),
                            np.clip(rng.lognormal(np.log(1500), 1.2, n), 16, seq_len)).astype(np.int64)
        else:
            raise ValueError(f"unknown workload {workload!r}")
        m = int(k.sum())
        if workload == "hires":
            p = rng.lognormal(np.log(6000), 0.7, m)
        elif workload == "interleaved":
            p = rng.lognormal(np.log(700), 0.6, m)
        else:
            p = rng.lognormal(np.log(1200), 1.0, m)
        p = (np.clip(p, 256, min(16384, max_patches)) // 4 * 4).astype(np.int64)
        off = np.concatenate([[0], np.cumsum(k)])
        sum_p = per_sample(p, off)
        L = text + sum_p // PATCHES_PER_TOKEN
        keep = (L <= seq_len) & (sum_p <= max_patches)  # a sample fits one micro-batch
        for i in np.flatnonzero(keep):
            toks.append(int(L[i]))
            pats.append(p[off[i]:off[i + 1]])
            counts.append(int(k[i]))
            total += int(L[i])
            if total >= budget:
                break
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    per_image = np.concatenate(pats).astype(np.int64) if pats else np.zeros(0, dtype=np.int64)
    audio = np.asarray(extra, dtype=np.float64).reshape(-1, 2) if extra else np.zeros((len(toks), 2))
    return np.asarray(toks, dtype=np.int64), per_image, offsets, audio[:, 0].copy(), audio[:, 1].astype(np.int64)


AUDIO_MIXES = {  # workload: shares of samples with a clip, an image, a video (the rest: text only)
    "audio-text": (0.85, 0.0, 0.0),
    "audio-images": (0.5, 0.25, 0.0),
    "audio-video": (0.4, 0.2, 0.2),
}
AUDIO_POLICIES = ("qwen2audio", "chunked")


def speech_seconds(rng: np.random.Generator, n: int) -> np.ndarray:
    """Clip durations of a speech corpus: utterances of 1-30 s (median 5 s), one in ten a long recording
    of 30 s to 2 min; rounded to the 10 ms feature hop."""
    short = np.clip(rng.lognormal(np.log(5), 0.8, n), 1, 30)
    long = np.clip(rng.lognormal(np.log(45), 0.5, n), 30, 120)
    return np.round(np.where(rng.random(n) < 0.1, long, short), 2)


def clip_tokens_and_costs(seconds: np.ndarray, policy_kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Placeholder tokens, audio encoder cost (Whisper-large-v3's dimensions, the spec's default) and the
    encoder's attention positions (the sum of the plan's spans) of each clip, as plait plans it under
    `policy_kind`: one plan per distinct duration."""
    from plait.cost import EncoderCost
    from plait.media.audio import AudioPolicy, encoder_cost
    from plait.media.audio_features import SAMPLE_RATE

    policy, whisper = AudioPolicy(policy_kind), EncoderCost.from_dims(1280, 32, 5120)
    distinct, back = np.unique(np.round(seconds * SAMPLE_RATE).astype(np.int64), return_inverse=True)
    plans = [policy.plan(int(samples)) for samples in distinct]
    tokens = np.array([plan.tokens for plan in plans], dtype=np.int64)
    costs = np.array([encoder_cost(plan, whisper.linear, whisper.quadratic) for plan in plans])
    spans = np.array([sum(plan.spans) for plan in plans], dtype=np.int64)
    return tokens[back], costs[back], spans[back]


def audio_samples(rng: np.random.Generator, n: int, seq_len: int, max_patches: int, workload: str, policy: str):
    """n samples of an audio workload that fit one micro-batch: (tokens, encoder sequences' patches, (audio
    encoder cost, audio encoder positions)) each. A clip's sample carries a short text (transcript, question, answer); text-only
    samples are documents. The draws do not depend on `policy`: both policies see the same samples."""
    shares = np.cumsum(AUDIO_MIXES[workload])
    kind = np.searchsorted(shares, rng.random(n), side="right")  # 0 clip, 1 image, 2 video, 3 text only
    short_text = np.clip(rng.lognormal(np.log(60), 0.8, n), 4, 2000).astype(np.int64)
    documents = np.clip(rng.lognormal(np.log(1500), 1.0, n), 16, seq_len).astype(np.int64)
    seconds = speech_seconds(rng, n)
    image = (np.clip(rng.lognormal(np.log(1200), 1.0, n), 256, 16384) // 4 * 4).astype(np.int64)
    video = video_patches(np.clip(rng.lognormal(np.log(30), 1.3, n), 2, 600), kind == 2)
    clip_tokens, clip_costs, clip_spans = clip_tokens_and_costs(seconds, policy)
    has_clip = kind == 0
    text = np.where(kind == 3, documents, short_text) + np.where(has_clip, clip_tokens, 0)
    costs = np.where(has_clip, clip_costs, 0.0)
    spans = np.where(has_clip, clip_spans, 0)
    toks, pats, kept = [], [], []
    for i in range(n):
        p = image[i:i + 1] if kind[i] == 1 else video[i]
        L = int(text[i] + p.sum() // PATCHES_PER_TOKEN)
        if L <= seq_len and p.sum() <= max_patches:
            toks.append(L)
            pats.append(p)
            kept.append((costs[i], spans[i]))
    return toks, pats, kept


def video_patches(seconds: np.ndarray, has_video: np.ndarray) -> list[np.ndarray]:
    """Per sample, its video's encoder sequences (t of h*w patches, 640x360 under the Qwen2-VL rule), or
    none where `has_video` is False."""
    from plait.media.video import VideoInfo, VideoPolicy

    policy, none = VideoPolicy(), np.zeros(0, np.int64)
    out = []
    for s, has in zip(seconds, has_video):
        if has:
            t, h, w = policy.plan(VideoInfo(640, 360, int(s * 30), 30.0, float(s), "h264")).grid
        out.append(np.full(t, h * w, np.int64) if has else none)
    return out


def video_samples(rng: np.random.Generator, n: int, seq_len: int, max_patches: int):
    """n samples of the `video` workload that fit one micro-batch: (tokens, per-sequence patches) each."""
    toks, pats = [], []
    draw = rng.random(n)
    text = np.clip(rng.lognormal(np.log(150), 0.9, n), 8, 4000).astype(np.int64)
    seconds = np.clip(rng.lognormal(np.log(30), 1.3, n), 2, 600)
    image = (np.clip(rng.lognormal(np.log(1200), 1.0, n), 256, 16384) // 4 * 4).astype(np.int64)
    video = video_patches(seconds, draw < 0.6)
    for i in range(n):
        if draw[i] < 0.6:
            p = video[i]
        elif draw[i] < 0.8:
            p = image[i:i + 1]
        else:
            p = np.zeros(0, np.int64)
        L = int(text[i] + p.sum() // PATCHES_PER_TOKEN)
        if L <= seq_len and p.sum() <= max_patches:
            toks.append(L)
            pats.append(p)
    return toks, pats, None


def per_sample(per_image, offsets):
    """Patches of each sample: the sum over its images (CSR offsets)."""
    acc = np.concatenate([[0], np.cumsum(per_image)]).astype(np.int64)
    return acc[offsets[1:]] - acc[offsets[:-1]]


# ----- strategies ------------------------------------------------------------------------------
def place_naive(lengths, loads, R, M, C, caps):
    """Each rank's contiguous share of the stream (M x C tokens), first-fit with every capacity (loads
    [n, K], caps [K])."""
    starts = np.cumsum(lengths) - lengths
    rank = np.minimum(starts // (M * C), R - 1)
    micro = np.full(len(lengths), -1, dtype=np.int64)
    tok = np.zeros((R, M), dtype=np.int64)
    held = np.zeros((R, M, loads.shape[1]), dtype=np.int64)
    for i in range(len(lengths)):
        r = rank[i]
        fit = np.flatnonzero((tok[r] + lengths[i] <= C) & (held[r] + loads[i] <= caps).all(axis=1))
        if len(fit):
            m = fit[0]
            micro[i] = m
            tok[r, m] += lengths[i]
            held[r, m] += loads[i]
    return np.where(micro >= 0, rank, -1), 0.0


def place_plait(lengths, costs, loads, R, M, C, caps, repeats):
    """balance.assign with every capacity (loads [n, K], caps [K]); plan_ms: CPU time of this thread,
    best of `repeats`."""
    from plait import balance

    best = float("inf")
    for _ in range(max(1, repeats)):
        t = time.thread_time()
        a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, loads=loads, load_capacity=caps)
        best = min(best, (time.thread_time() - t) * 1e3)
    return a.rank.astype(np.int64), best


def measure(rank, lengths, costs, loads, R, M, C, caps) -> dict:
    from plait.balance import capacity_lower_bound

    ok = rank >= 0
    rank_cost = np.bincount(rank[ok], weights=costs[ok], minlength=R)
    lb = capacity_lower_bound(lengths[ok], costs[ok], loads[ok], ranks=R, microbatches=M, capacity=C,
                              load_capacity=caps)
    mean = float(rank_cost.sum()) / R
    return {
        "max_over_lb": float(rank_cost.max() / lb) if lb > 0 else 1.0,
        "max_over_mean": float(rank_cost.max() / mean) if mean > 0 else 1.0,
        "fill": float(lengths[ok].sum() / (R * M * C)),
        "placed": float(ok.mean()) if len(ok) else 1.0,
    }


def encoder_loads(patches, audio_spans, args, workload) -> tuple[np.ndarray, np.ndarray]:
    """The balancer's encoder capacities: patches, and with --max-audio-spans on an audio workload the
    audio encoder's positions too."""
    if args.max_audio_spans is None or workload not in AUDIO_MIXES:
        return patches.reshape(-1, 1), np.array([args.max_patches])
    return np.stack([patches, audio_spans], axis=1), np.array([args.max_patches, args.max_audio_spans])


def sweep(workloads, dps, args, progress=None) -> list[dict]:
    llm, vit = cost_models(args.encoder)
    C, Pc, M = args.seq_len, args.max_patches, args.microbatches
    rows = []
    steps = [(workload, dp, policy) for workload in workloads for dp in dps
             for policy in (args.audio_policy_list if workload in AUDIO_MIXES else [None])]
    for workload, dp, policy in steps:
        # seeded by the workload's name, not its place in --workloads: a row is the same in any selection,
        # and both audio policies see the same samples
        rng = np.random.default_rng([args.seed, WORKLOADS.index(workload), dp])
        lengths, per_image, offsets, audio_cost, audio_spans = sample_step(workload, dp * M * C, C, Pc, rng, policy)
        loads, caps = encoder_loads(per_sample(per_image, offsets), audio_spans, args, workload)
        text_cost = llm(lengths)
        total = text_cost + vit.per_item(per_image, offsets) + audio_cost
        enc_share = float(1.0 - text_cost.sum() / total.sum())
        placed = {
            "naive": place_naive(lengths, loads, dp, M, C, caps),
            "llm-only": place_plait(lengths, text_cost, loads, dp, M, C, caps, args.repeats),
            "plait": place_plait(lengths, total, loads, dp, M, C, caps, args.repeats),
        }
        for name in STRATEGIES:
            rank, plan_ms = placed[name]
            row = {"workload": workload, "dp": dp, "strategy": name, "samples": len(lengths),
                   "samples_per_rank": len(lengths) / dp, "encoder_share": enc_share}
            if policy:
                row["audio_policy"] = policy
            if len(caps) > 1:
                row["max_audio_spans"] = int(caps[1])
            row.update(measure(rank, lengths, total, loads, dp, M, C, caps))
            row["plan_ms"] = plan_ms
            rows.append(row)
        if progress:
            progress()
    return rows


def run(args) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.table import Table

    from plait import balance
    from plait.errors import PlaitError

    err = Console(stderr=True)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise PlaitError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    try:
        dps = [int(x) for x in args.dp.split(",") if x.strip()]
    except ValueError:
        raise PlaitError(f"expected comma-separated integers, got {args.dp!r}") from None
    if min(dps + [args.seq_len, args.max_patches, args.microbatches]) < 1:
        raise PlaitError("dp, seq_len, max_patches and microbatches must be >= 1")
    if args.max_audio_spans is not None and args.max_audio_spans < 1500:
        raise PlaitError("max_audio_spans must hold one padded 30 s window (1,500 encoder positions)")
    if args.max_patches < 256:
        raise PlaitError("max_patches must hold one image of the smallest size (256 patches)")
    args.audio_policy_list = [x.strip() for x in args.audio_policies.split(",") if x.strip()]
    if not args.audio_policy_list or set(args.audio_policy_list) - set(AUDIO_POLICIES):
        raise PlaitError(f"audio policies must be among {', '.join(AUDIO_POLICIES)}, got {args.audio_policies!r}")
    balance.warmup()
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]multimodal[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=err, disable=args.quiet) as bar:
        per_dp = sum(len(args.audio_policy_list) if w in AUDIO_MIXES else 1 for w in workloads)
        task = bar.add_task("sweep", total=per_dp * len(dps))
        rows = sweep(workloads, dps, args, progress=lambda: bar.advance(task))
    if not args.quiet:
        out = Console()
        t = Table(title=f"multimodal balance: seq_len {args.seq_len}, max_patches {args.max_patches}, "
                        f"{args.microbatches} micro-batches, {args.encoder} encoder ({time.perf_counter() - t0:.0f} s)")
        for col, just in (("workload", "left"), ("dp", "right"), ("samples/rank", "right"), ("encoder", "right"),
                          ("strategy", "left"), ("max/LB", "right"), ("max/mean", "right"), ("fill", "right"),
                          ("plan ms", "right")):
            t.add_column(col, justify=just)
        for r in rows:
            t.add_row(" ".join(filter(None, (r["workload"], r.get("audio_policy")))), str(r["dp"]), f"{r['samples_per_rank']:.0f}", f"{r['encoder_share']:.0%}",
                      r["strategy"], f"{r['max_over_lb']:.4f}", f"{r['max_over_mean']:.4f}", f"{r['fill']:.3f}",
                      f"{r['plan_ms']:.1f}" if r["strategy"] != "naive" else "-")
        out.print(t)
        out.print("max/LB: slowest rank's total (encoder + LLM) cost over the capacity-aware lower bound of the "
                  "placed samples; llm-only balances LLM cost alone, measured under the total.")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        err.print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.modules[__name__]))
