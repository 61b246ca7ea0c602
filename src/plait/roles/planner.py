"""Planner: the data plane. One per job.

For each global step it
  1. decides how many tokens each source contributes (mixture quotas, error diffusion),
  2. takes that many tokens from each source in the source's deterministic order (metadata only), chunk
     by chunk: a document longer than seq_len is cut into chunks of seq_len tokens that are drawn over as
     many steps as the source's share allows (the cursor remembers the offset inside the document),
  3. assigns every chunk to a (DP rank, micro-batch) minimising the slowest rank's cost (balance.py),
  4. carries what did not fit (rare) to the next step, ahead of new documents.

Its state (per-source cursor and deficit, the carried chunks, the step) is a few hundred bytes plus the
carry, and fully defines the rest of the data stream: a checkpoint of the Planner is a checkpoint of the
data. It never sees a token id.
"""

from __future__ import annotations

import copy
import logging
from typing import Protocol

import numpy as np

from plait import balance
from plait.cost import CostModel, EncoderCost
from plait.errors import PlaitError, SourceError
from plait.mixture import take_count
from plait.plan import Items, StepPlan
from plait import packing_phases as phases
from plait.state.spec_change import carry_over, split_fingerprint
from plait.state.schema import STATE_VERSION, check_data_state, parse_data_state
from plait.state.overrides import RunWeights
from plait.sources.multimodal import placeholder_leads
from plait.spec import Spec


CAPACITY_LB_ITEMS = 8_000  # max_over_capacity_lb on every step of at most this many items (~15 ms) ...
CAPACITY_LB_EVERY = 10  # ... else on every 10th step
log = logging.getLogger("plait.planner")
TOPUP_ROUNDS = 16  # split: boundary: draws to find tokens for the step's unfilled room (deficits may be < 0)


def encoder_cost(spec: Spec) -> EncoderCost | None:
    """The vision encoder's per-image cost from `cost.encoder` (None: images cost nothing to encode)."""
    e = spec.cost.encoder
    if e is None:
        return None
    if e.linear is not None:
        return EncoderCost(float(e.linear), float(e.quadratic))
    return EncoderCost.from_dims(e.hidden, e.layers, e.ffn)


class MetadataProvider(Protocol):
    """Where the Planner gets block metadata: a SourceLoader (local) or a proxy to loader actors."""

    def first_key(self, source: int) -> tuple[int, int, int]: ...

    def block_meta(self, source: int, key: tuple[int, int, int]): ...


class Planner:
    def __init__(self, spec: Spec, provider: MetadataProvider, *, dp: int | None = None):
        self.spec = spec
        self.provider = provider
        self.ranks = dp or spec.topology.dp
        self.seq_len, self.microbatches = spec.packing.phase_at(0)  # the phase's (packing.schedule)
        self.capacity = self.seq_len
        self.limits = phases.chunk_limits(spec, self.seq_len)  # longest chunk per source (max_chunk)
        self.grains = phases.granules(spec)  # chunk numbering (packing_phases.py)
        self.cp = spec.topology.cp
        self.cost_model = CostModel.from_spec(spec.cost)
        self.encoder = encoder_cost(spec)
        self.images = spec.images is not None  # a second capacity (patches) and the encoder's cost
        self.max_patches = spec.packing.max_patches
        self.weights = RunWeights(spec)  # the spec's schedule, run-time overrides, online policy
        self.mixture = self.weights.schedule
        n = len(spec.sources)
        self.step = 0
        # epoch, file_pos, block_pos, position, offset (tokens of the document at `position` already drawn)
        self.cursor = np.zeros((n, 5), dtype=np.int64)
        self.deficit = np.zeros(n, dtype=np.float64)
        self.drawn = np.zeros(n, dtype=np.int64)  # tokens drawn per source (metrics only)
        self.delivered_tokens = 0  # tokens and samples (chunks) placed in the steps planned so far
        self.delivered_samples = 0
        self.carry = Items.empty()
        self._meta: dict[int, object] = {}
        self.empty_docs = 0  # zero-token documents skipped in the step being planned
        # what decides the sources' order : what decides their shares (a resume checks both)
        self.fingerprint = f"{spec.data_fingerprint()}:{spec.mixture_fingerprint()}"
        self.source_fingerprints = [spec.source_fingerprint(n) for n in spec.source_names]
        self.parked: dict = {}  # sources a spec change removed: cursor, deficit, carried chunks
        self.resume_changes: list[str] = []  # what the last allow_spec_change resume found changed
        self.repeat_warned: set[int] = set()  # sources said to repeat within one step (warned once each)
        for i in range(n):
            self.cursor[i, :3] = provider.first_key(i)

    # ----- the algorithm -----------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        state_before = self.state_dict()
        drawn_before = self.drawn.copy()
        self.empty_docs = 0
        self._enter_phase()
        step_capacity = self.ranks * self.microbatches * self.capacity
        carry_tokens = int(self.carry.length.sum())
        budget = max(0, step_capacity - carry_tokens)
        weights = self.weights.at(self.step, self.delivered_tokens)
        if self.mixture.windowed:  # a source outside its window draws nothing: drop its leftover quota
            off = ~self.mixture.active(self.step)
            self.deficit[off] = np.minimum(self.deficit[off], 0.0)
        self.deficit += weights * budget
        new = Items.concat([self.draw(i) for i in range(len(self.spec.sources))])
        items = Items.concat([self.carry, new])
        priority = np.concatenate([self.carry.delayed + 1, np.zeros(len(new), dtype=np.int64)])
        held = self._hold_outliers(items)
        if held.any():
            # Held outliers wait in the carry; the mixture tops the step up with as many tokens.
            topup = int(items.length[held].sum())
            self.deficit += weights * topup
            extra = Items.concat([self.draw(i) for i in range(len(self.spec.sources))])
            outliers = items.take(np.flatnonzero(held))
            items = Items.concat([items.take(np.flatnonzero(~held)), extra])
            priority = np.concatenate([priority[~held], np.zeros(len(extra), dtype=np.int64)])
        else:
            outliers = Items.empty()
        cap = self.spec.packing.max_long_per_step
        if cap is not None:  # long chunks beyond the cap wait in the carry, ahead of new ones next step
            held = phases.hold_long(items, priority, cap.min_tokens, cap.per_rank * self.ranks)
            outliers = Items.concat([outliers, items.take(np.flatnonzero(held))])
            items, priority = items.take(np.flatnonzero(~held)), priority[~held]
        # Per-GPU cost: with context parallelism each CP rank of a replica carries cost / cp.
        costs, encoder = self._costs(items)
        result = balance.assign(
            items.length, costs, ranks=self.ranks, microbatches=self.microbatches, capacity=self.capacity,
            priority=priority, mode=self.spec.balance.mode,
            patches=items.patches if self.images else None, patch_capacity=self.max_patches if self.images else None,
        )
        if cap is not None:
            phases.cap_long_per_rank(result, items, costs, cap.min_tokens, cap.per_rank)
        placed = np.flatnonzero(result.placed)
        left = np.flatnonzero(~result.placed)
        out = (items.take(placed), costs[placed], result.rank[placed], result.micro[placed])
        cut = 0
        if self.spec.packing.split == "boundary":
            out, rest, cut = self._fill(result, items, costs, priority, out, weights)
        else:
            rest = items.take(left)
        self.carry = Items.concat([outliers, rest])
        self.carry.delayed = self.carry.delayed + 1
        plan = StepPlan(
            step=self.step,
            ranks=self.ranks,
            microbatches=int(result.micro_cost.shape[1]),
            capacity=self.capacity,
            items=out[0],
            cost=out[1],
            rank=out[2],
            micro=out[3],
            rank_cost=result.rank_cost,
            micro_cost=result.micro_cost,
            micro_tokens=result.micro_tokens,
            lower_bound=balance.lower_bound(out[1], self.ranks),
            carried=len(self.carry),
            delayed_outliers=len(outliers),
            documents_cut=cut,
            empty_documents=self.empty_docs,
            state_before=state_before,
            rank_microbatches=result.microbatches,
            vocab_size=self.spec.vocab_size,
            label_horizon=self.spec.packing.label_horizon,
            weights=weights,
            drawn=self.drawn - drawn_before,
        )
        plan.max_over_capacity_lb = self._capacity_certificate(result, items, costs)
        if self.images:
            plan.images = self._image_stats(result, items, encoder, costs, placed)
        self.delivered_tokens += plan.tokens
        self.delivered_samples += len(plan.items)
        self.step += 1
        return plan

    def _enter_phase(self) -> None:
        """The step's sequence-length phase (packing.schedule): seq_len, micro-batches, chunk limits.
        Carried chunks longer than the new limits are re-cut at exact token offsets (packing_phases.py); a
        document drawn part-way continues from its cursor's token offset in chunks of the new length."""
        self.seq_len, self.microbatches = self.spec.packing.phase_at(self.step)
        self.capacity = self.seq_len
        self.limits = phases.chunk_limits(self.spec, self.seq_len)
        self.carry = phases.recut(self.carry, self.limits, self.grains)

    def _fill(self, result, items: Items, costs: np.ndarray, priority: np.ndarray, out: tuple, weights):
        """split: boundary: fill every micro-batch's room with head pieces of unplaced chunks, drawing
        more first when the unplaced tokens cannot fill the room. Returns (placed, rest, pieces cut)."""
        run = np.arange(result.micro_tokens.shape[1])[None, :] < result.microbatches[:, None]
        room = int(((self.capacity - result.micro_tokens) * run).sum())
        left = np.flatnonzero(~result.placed)
        short = room - int(items.length[left].sum())
        for _ in range(TOPUP_ROUNDS):  # top the step up: the mixture's shares of the missing tokens
            if short <= 0:
                break
            self.deficit += weights * short
            extra = Items.concat([self.draw(i) for i in range(len(self.spec.sources))])
            n = len(items)
            items = Items.concat([items, extra])
            costs = np.concatenate([costs, self._costs(extra)[0]])
            priority = np.concatenate([priority, np.zeros(len(extra), dtype=np.int64)])
            left = np.concatenate([left, np.arange(n, len(items))])
            short -= int(extra.length.sum())
        order = left[np.lexsort((left, -priority[left]))]
        cap = self.spec.packing.max_long_per_step
        longest = cap.min_tokens - 1 if cap is not None else None  # a piece never counts as a long chunk
        pieces, ranks, micros, piece_costs, rest, cut = phases.fill_boundary(
            result, items, order, self.capacity, lambda n: self.cost_model.per_cp_rank(n, self.cp), longest)
        placed = (Items.concat([out[0], pieces]), np.concatenate([out[1], piece_costs]),
                  np.concatenate([out[2], ranks]), np.concatenate([out[3], micros]))
        return placed, rest, cut

    def _costs(self, items: Items) -> tuple[np.ndarray, np.ndarray]:
        """Each item's cost per CP rank (LLM over its tokens + encoder over its images, both split over
        the cp ranks), and the encoder's part of it."""
        costs = self.cost_model.per_cp_rank(items.length, self.cp)
        if self.encoder is None or not items.has_images:
            return costs, np.zeros(len(items))
        encoder = (self.encoder.linear * items.patches + self.encoder.quadratic * items.patches_sq) / max(1, self.cp)
        return costs + encoder, encoder

    def _capacity_certificate(self, result, items: Items, costs: np.ndarray) -> float | None:
        """The step's certificate against the capacity-aware bound (balance.max_over_capacity_lb: tokens
        per rank, and patches with images): only on steps of at most CAPACITY_LB_ITEMS items, or every
        CAPACITY_LB_EVERY steps, as it is slow on huge steps; None when skipped."""
        if len(items) > CAPACITY_LB_ITEMS and self.step % CAPACITY_LB_EVERY != 0:
            return None
        return balance.max_over_capacity_lb(result, items.length, costs, items.patches if self.images else None,
                                            microbatches=int(result.micro_cost.shape[1]), capacity=self.capacity,
                                            patch_capacity=self.max_patches if self.images else None)

    def _image_stats(self, result, items: Items, encoder: np.ndarray, costs: np.ndarray, placed: np.ndarray) -> dict:
        """Patches per micro-batch and the encoder's share of the cost."""
        micro_patches = result.micro_patches if result.micro_patches is not None else np.zeros_like(result.micro_tokens)
        return {"micro_patches": micro_patches, "encoder_cost": float(encoder[placed].sum()),
                "cost": float(costs[placed].sum()), "masked_labels": self._masked_labels(items.take(placed))}

    def _masked_labels(self, items: Items) -> int:
        """Labels the Constructor sets to -100 over image placeholders in these items: one per placeholder
        (patches / merge**2 of them), less the first one where a document starts with a placeholder
        (nothing predicts it: multimodal.placeholder_leads). Text items mask none."""
        merge = self.spec.images.merge
        leads = np.array([placeholder_leads(s) for s in self.spec.sources], dtype=np.int64)
        with_images = items.patches > 0
        return int((items.patches // (merge * merge)).sum() - (leads[items.source] * with_images).sum())

    def _hold_outliers(self, items: Items) -> np.ndarray:
        """Which items to delay: outliers (cost > outlier_factor x mean rank load), held until enough
        gather to give every rank one, or until one has waited max_delay steps; then all go together.

        One outlier in a step makes that step as slow as the outlier; gathering them makes one slow step
        out of many instead of many slow steps. Off unless balance.max_delay > 0.
        """
        held = np.zeros(len(items), dtype=bool)
        max_delay = self.spec.balance.max_delay
        if max_delay <= 0 or not len(items):
            return held
        costs = self._costs(items)[0]
        outlier = costs > self.spec.balance.outlier_factor * float(costs.sum()) / self.ranks
        if not outlier.any():
            return held
        if int(outlier.sum()) >= self.ranks or bool((items.delayed[outlier] >= max_delay).any()):
            return held
        return outlier

    def draw(self, source: int) -> Items:
        """Take chunks from one source while the next chunk starts before its deficit is used up.

        Error diffusion at chunk granularity: a document longer than seq_len is drawn chunk by chunk over
        as many steps as the source's share allows (the cursor's last field is the offset reached inside
        the current document), so a giant document never floods a step or the carry and every source
        stays within one chunk of its target share. A document of at most seq_len tokens is one chunk.
        """
        parts: list[Items] = []
        got = 0  # tokens: a source of only empty documents must fail, not loop forever
        start_epoch = int(self.cursor[source, 0])
        S = int(self.limits[source])
        while self.deficit[source] > 0:
            epoch, fpos, bpos, pos, offset = (int(x) for x in self.cursor[source])
            meta = self._block_meta(source, (epoch, fpos, bpos))
            first = int(np.searchsorted(meta.positions, pos))
            remaining = meta.lengths[first:].astype(np.int64)
            if offset:
                if not len(remaining) or int(meta.positions[first]) != pos or offset >= remaining[0]:
                    raise PlaitError(
                        f"source {self.spec.sources[source].name!r}: the data state points {offset} tokens into "
                        f"document {pos} of block {(epoch, fpos, bpos)}, which that block does not hold")
                remaining[0] -= offset
            deficit = float(self.deficit[source])
            k = take_count(remaining, deficit)  # documents whose rest starts before the deficit is used up
            end = 0  # chunks taken of the last of them (0: the whole rest)
            if k:
                start = int(remaining[:k - 1].sum())
                rest = int(remaining[k - 1])
                if start + rest > deficit:  # the last one ends past the deficit: take its chunks that start before
                    m = int((deficit - start) // S)
                    end = m + (start + m * S < deficit)
                    if end * S >= rest:
                        end = 0
                sel = np.arange(first, first + k)
                items = self._docs_to_items(meta, sel, offset, end, S, int(self.grains[source]))
                parts.append(items)
                taken = int(items.length.sum())
                got += taken
                self.deficit[source] -= taken
                self.drawn[source] += taken
            if end:
                self.cursor[source, 3:] = (meta.positions[first + k - 1], (offset if k == 1 else 0) + end * S)
            elif first + k < len(meta.positions):
                self.cursor[source, 3:] = (meta.positions[first + k], 0)
            else:
                self.cursor[source] = (*meta.next_key, 0, 0)
                self._meta.pop(source, None)
                if not got and self.cursor[source, 0] > start_epoch + 1:
                    name = self.spec.sources[source].name
                    raise SourceError(name, None, None, "no readable, non-empty documents in a whole epoch")
        self._warn_repeats(source, int(self.cursor[source, 0]) - start_epoch, got)
        return Items.concat(parts)

    def _warn_repeats(self, source: int, epochs: int, tokens: int) -> None:
        """A source read whole more than once in one draw is smaller than its share of a step (e.g. a
        seq_len above its total tokens): the step repeats its documents. Said once per source."""
        if epochs < 2 or source in self.repeat_warned:
            return
        self.repeat_warned.add(source)
        log.warning(
            "source %r was read whole (at least %d time(s)) for step %d (%d tokens drawn from it): it holds fewer tokens than "
            "its share of one step, so the step repeats its documents; add data, lower its weight, or lower "
            "packing.seq_len / microbatches", self.spec.sources[source].name, epochs - 1, self.step, tokens)

    def _block_meta(self, source: int, key: tuple[int, int, int]):
        meta = self._meta.get(source)
        if meta is None or tuple(meta.key) != key:
            meta = self.provider.block_meta(source, key)
            self._meta[source] = meta
        return meta

    def _docs_to_items(self, meta, sel: np.ndarray, offset: int, end: int, S: int, grain: int) -> Items:
        """Chunks of at most S tokens of the documents `sel`: the first one from `offset` tokens in (its
        earlier chunks were drawn in earlier steps); of the last one only its first `end` chunks when end > 0.
        Chunk numbers: ceil(offset / grain) (packing_phases.py)."""
        lengths = meta.lengths[sel].astype(np.int64)
        skip = np.zeros(len(sel), dtype=np.int64)
        skip[:1] = offset
        # Offsets are exact token counts; chunk numbers continue the document's (rounded up, so that a
        # state resumed with a smaller seq_len cannot reuse a number already delivered).
        nchunks = -(-(lengths - skip) // S)
        if end:
            nchunks[-1] = end
        nonempty = lengths > 0
        self.empty_docs += int((~nonempty).sum())
        sel, lengths, skip, nchunks = (a[nonempty] for a in (sel, lengths, skip, nchunks))
        doc = np.repeat(np.arange(len(sel)), nchunks)
        j = np.arange(len(doc)) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)  # chunk within this draw
        offsets = skip[doc] + j * S
        chunk = -(-offsets // grain)
        length = np.minimum(S, lengths[doc] - offsets)
        m = len(doc)

        def full(v: int) -> np.ndarray:
            return np.full(m, v, dtype=np.int64)

        epoch, fpos, bpos = meta.key
        patches = getattr(meta, "patches", None)  # a document with images is never cut: one chunk
        image_columns = {} if patches is None else {
            "patches": patches[sel][doc].astype(np.int64), "patches_sq": meta.patches_sq[sel][doc].astype(np.int64)}
        return Items(
            source=full(meta.source), epoch=full(epoch), fpos=full(fpos), bpos=full(bpos),
            position=meta.positions[sel][doc].astype(np.int64), shard=full(meta.shard),
            row=meta.rows[sel][doc].astype(np.int64), chunk=chunk.astype(np.int64), offset=offsets.astype(np.int64),
            length=length.astype(np.int64), delayed=full(0), **image_columns,
        )

    # ----- data state --------------------------------------------------------------------------
    def live_blocks(self) -> set[tuple[int, int, int, int]]:
        """Blocks that the Planner will still read from (its cursors) or that hold carried chunks."""
        live = {(i, *map(int, self.cursor[i, :3])) for i in range(len(self.spec.sources))}
        live.update(self.carry.block_keys()[0])
        return live

    def state_dict(self) -> dict:
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "sources": {
                s.name: {"cursor": self.cursor[i].tolist(), "deficit": float(self.deficit[i]), "drawn": int(self.drawn[i]),
                         "fingerprint": self.source_fingerprints[i]}
                for i, s in enumerate(self.spec.sources)
            },
            "carry": self.carry.to_rows(),
            "delivered": {"tokens": self.delivered_tokens, "samples": self.delivered_samples},
            **self.weights.state_items(),
        }
        if self.parked:
            state["parked"] = copy.deepcopy(self.parked)
        return state

    # ----- run-time mixing ---------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """Pin the named sources' token shares from step `at_step` on (recorded in the data state); a
        step already planned is refused."""
        self.weights.set(weights, int(at_step), planned=self.step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        """Per-source training losses of `step`, for the online mixing policy (mixture.online)."""
        self.weights.report(int(step), losses, planned=self.step)

    def _check_cursors(self) -> None:
        """Every cursor must name a block of its source and a document in it (a tampered or foreign
        state would otherwise fail later, or silently read elsewhere)."""
        for i, s in enumerate(self.spec.sources):
            epoch, fpos, bpos, pos, offset = (int(x) for x in self.cursor[i])
            try:
                meta = self._block_meta(i, (epoch, fpos, bpos))
            except (IndexError, KeyError, ValueError) as e:
                raise PlaitError(
                    f"the data state's cursor of source {s.name!r} (file {fpos}, block {bpos}) is outside the "
                    f"source ({type(e).__name__}: {e}); the state was edited or belongs to other data"
                ) from None
            ends = meta.positions
            if pos > (int(ends[-1]) if len(ends) else 0) or (offset and pos not in set(ends.tolist())):
                raise PlaitError(
                    f"the data state's cursor of source {s.name!r} points at document {pos} (offset {offset}), "
                    "which its block does not hold; the state was edited or belongs to other data"
                )

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        """Continue from a data state: validated (schema, then ranges against the spec and the data).

        With `allow_spec_change`, a state saved under another mixture or set of sources continues under
        this spec (state/spec_change.py says what may change); returns the changes found (also kept in
        `resume_changes`)."""
        changes: list[str] = []
        saved = state.get("fingerprint") if isinstance(state, dict) else None
        if isinstance(saved, str) and saved != self.fingerprint:
            data_fp, mix_fp = split_fingerprint(saved)
            if mix_fp is None and data_fp == self.spec.legacy_fingerprint():
                state = {**state, "fingerprint": self.fingerprint}  # a state written before run-time mixing
            elif allow_spec_change:
                parse_data_state(state)  # its shape, before reading it
                state, changes = carry_over(self.spec, state, self.provider.first_key)
        check_data_state(state, self.spec, self.fingerprint)
        state = copy.deepcopy(state)
        self.step = int(state["step"])
        for i, s in enumerate(self.spec.sources):
            src = state["sources"][s.name]
            cursor = list(src["cursor"])
            self.cursor[i] = cursor + [0] * (5 - len(cursor))  # states before chunk-level drawing: 4 fields
            self.deficit[i] = src["deficit"]
            self.drawn[i] = src["drawn"]
        self.carry = Items.from_rows(state["carry"])
        self.weights.load(state)
        self.parked = copy.deepcopy(state.get("parked") or {})
        delivered = state.get("delivered") or {"tokens": 0, "samples": 0}
        self.delivered_tokens, self.delivered_samples = int(delivered["tokens"]), int(delivered["samples"])
        self._meta.clear()
        self._check_cursors()
        # The state is layout-free, with one limit: carried chunks were cut for the saved seq_len and
        # must still fit a micro-batch, or they could never be delivered.
        if not self.spec.packing.schedule and len(self.carry) and int(self.carry.length.max()) > self.capacity:
            raise PlaitError(
                f"the data state carries chunks of up to {int(self.carry.length.max())} tokens, more than this "
                f"layout's micro-batch capacity ({self.capacity}); resume with seq_len >= that"
            )
        self.resume_changes = changes
        return changes
