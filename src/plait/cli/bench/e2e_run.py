"""The simulated training job of `plait bench e2e` (plait.cli.bench.e2e explains it): the GPU clock,
synchronous DP ranks as threads, the summary, and one run of plait on the local runtime."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np


# ----- the simulated GPU -------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuClock:
    """Seconds a micro-batch computes: its cost-model FLOPs (LLM per document + encoder per image) over
    the GPU's effective FLOP/s."""

    llm: object  # plait.cost.CostModel
    encoder: object  # plait.cost.EncoderCost
    flops_per_s: float

    @classmethod
    def of_spec(cls, spec, tflops: float) -> GpuClock:
        from plait.cost import CostModel
        from plait.roles.planner import encoder_cost

        return cls(CostModel.from_spec(spec.cost), encoder_cost(spec), tflops * 1e12)

    def seconds(self, doc_lengths: np.ndarray, image_patches: np.ndarray) -> float:
        flops = float(self.llm.text(doc_lengths).sum())
        if len(image_patches):
            flops += float(self.encoder(image_patches).sum())
        return flops / self.flops_per_s


def plait_shape(mb) -> tuple[np.ndarray, np.ndarray, int]:
    """(document lengths, patches per image, tokens) of a plait.Batch."""
    patches = mb.image_grid.prod(axis=1) if mb.image_grid is not None else np.zeros(0, np.int64)
    return np.diff(mb.cu_seqlens), patches, mb.num_tokens


# ----- the synchronous step clock ----------------------------------------------------------------
@dataclass
class Trace:
    """What the ranks did, per step and rank: seconds waiting for data, seconds computing, tokens; and
    when each step ended (every rank done), on perf_counter's clock from `start`."""

    start: float
    waits: np.ndarray  # [steps, ranks]
    computes: np.ndarray  # [steps, ranks]
    tokens: np.ndarray  # [steps, ranks]
    step_ends: np.ndarray  # [steps]
    images: np.ndarray | None = None  # [steps, ranks]: images delivered


def run_synchronous(streams: list, steps: int, microbatches: int, clock: GpuClock, shape) -> Trace:
    """Run `steps` synchronous steps: rank r takes `microbatches` micro-batches of `streams[r]` per step,
    computing each for the clock's time (a sleep), then waits at the step's barrier."""
    ranks = len(streams)
    waits, computes, tokens, images = (np.zeros((steps, ranks)) for _ in range(4))
    ends = np.zeros(steps)
    done = [0]

    def step_ended():  # run by one thread once all have arrived
        ends[done[0]] = time.perf_counter()
        done[0] += 1

    barrier = threading.Barrier(ranks, action=step_ended)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        it = iter(streams[r])
        try:
            for s in range(steps):
                for _ in range(microbatches):
                    t = time.perf_counter()
                    mb = next(it)
                    waits[s, r] += time.perf_counter() - t
                    lengths, patches, n = shape(mb)
                    seconds = clock.seconds(lengths, patches)
                    time.sleep(seconds)
                    computes[s, r] += seconds
                    tokens[s, r] += n
                    images[s, r] += len(patches)
                barrier.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            barrier.abort()

    start = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Trace(start, waits, computes, tokens, ends, images)


def balance_loss(computes: np.ndarray) -> float:
    """Mean over steps of 1 - mean/max of the ranks' compute times (0: perfectly balanced)."""
    c = np.asarray(computes, dtype=np.float64)
    top = c.max(axis=1)
    loss = np.where(top > 0, 1.0 - c.mean(axis=1) / np.where(top > 0, top, 1.0), 0.0)
    return float(loss.mean()) if len(loss) else 0.0


def summarize(trace: Trace, warmup: int) -> dict:
    """Rates over the steps after `warmup` (at least one step is kept)."""
    steps, ranks = trace.waits.shape
    w = max(0, min(warmup, steps - 1))
    t0 = trace.step_ends[w - 1] if w > 0 else trace.start
    wall = max(float(trace.step_ends[-1] - t0), 1e-9)
    measured = steps - w
    computes = trace.computes[w:]
    return {
        "steps": int(steps), "measured_steps": int(measured), "seconds": wall,
        "steps_per_s": measured / wall,
        "wait_fraction": float(trace.waits[w:].sum() / (ranks * wall)),
        "compute_fraction": float(computes.sum() / (ranks * wall)),
        "balance_loss": balance_loss(computes),
        "compute_bound_steps_per_s": measured / max(float(computes.max(axis=1).sum()), 1e-9),
        "tokens_per_s": float(trace.tokens[w:].sum() / wall),
        "tokens_per_step": float(trace.tokens.sum() / steps),
        "startup_s": float(trace.step_ends[w - 1] - trace.start) if w > 0 else 0.0,
        # each measured step's wall time: a pipeline that drains every few steps shows as a periodic spike
        "step_seconds": np.diff(np.concatenate([[t0], trace.step_ends[w:]])).round(4).tolist(),
    }


# ----- plait on the local runtime ----------------------------------------------------------------
def load_average() -> float:
    """The machine's 1-minute load average (recorded at each row's start and end: this bench shares the
    machine's cores, so a row is read against the load it ran under)."""
    return round(os.getloadavg()[0], 2)


def run_plait_local(spec, args, clock: GpuClock) -> dict:
    """plait as one machine runs it without services: the local runtime in this process, reading every
    rank (LocalRuntime all_ranks: each step planned once, every rank's micro-batches built ahead on build
    threads, several ranks at once), one SourceLoader decoding on `loading.workers` = --cpus threads."""
    from plait.runtime.local import LocalRuntime
    from plait.sources.workers import resolve_workers

    spec = spec.with_overrides(loading={"workers": args.cpus})
    load_before = load_average()
    t0 = time.perf_counter()
    rt = LocalRuntime(spec, all_ranks=True)
    try:
        start = rt.state_dict()
        streams = [(mb for _, mb in rt.iter_rank(r, start, 0, args.steps)) for r in range(spec.topology.dp)]
        trace = run_synchronous(streams, args.steps, args.microbatches, clock, plait_shape)
        trace.start = t0
        row = summarize(trace, args.warmup)
        images = rt.loader.images_decoded
        threads = len(rt.service.cache.workers.threads)
    finally:
        rt.close()
    row.update(runtime="local", workers=resolve_workers(spec.loading.workers), build_threads=threads,
               images_decoded=images, images_delivered=int(trace.images.sum()),
               load_average=[load_before, load_average()])
    return row
