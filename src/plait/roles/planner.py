"""Planner: the data plane. One per job.

For each global step it
  1. decides how many tokens each source contributes (mixture quotas, error diffusion),
  2. takes that many tokens from each source in the source's deterministic order (metadata only), chunk
     by chunk: a document longer than seq_len is cut into chunks of seq_len tokens that are drawn over as
     many steps as the source's share allows (the cursor remembers the offset inside the document),
  3. assigns every chunk to a (DP rank, micro-batch) minimising the slowest rank's cost (plait.balance),
  4. carries what did not fit (rare) to the next step, ahead of new documents.

Its state (per-source cursor and deficit, the carried chunks, the step) is a few hundred bytes plus the
carry, and fully defines the rest of the data stream: a checkpoint of the Planner is a checkpoint of the
data. It never sees a token id.

The Planner holds the step loop and the data state; drawing from the sources (cursors, deficits: 1, 2)
is plait.planning.draws, the items' costs and the step's cost figures plait.planning.step_costs.
"""

from __future__ import annotations

import copy

import numpy as np

from plait import balance
from plait.errors import PlaitError
from plait.plan import Items, StepPlan
from plait import packing_phases as phases
from plait.planning.draws import MetadataProvider, SourceDraws
from plait.planning.dynamic_cp import DynamicCP, finish_step
from plait.planning.step_costs import CAPACITY_LB_EVERY, CAPACITY_LB_ITEMS, StepCosts, encoder_cost
from plait.state.spec_change import carry_over, split_fingerprint
from plait.state.schema import STATE_VERSION, check_data_state, parse_data_state
from plait.state.overrides import RunWeights
from plait.spec import Spec

# Re-exported: other modules and users import these from here.
__all__ = ["CAPACITY_LB_EVERY", "CAPACITY_LB_ITEMS", "MetadataProvider", "Planner", "TOPUP_ROUNDS", "encoder_cost"]

TOPUP_ROUNDS = 16  # split: boundary: draws to find tokens for the step's unfilled room (deficits may be < 0)


class Planner:
    def __init__(self, spec: Spec, provider: MetadataProvider, *, dp: int | None = None):
        self.spec = spec
        self.ranks = dp or spec.topology.dp
        self.seq_len, self.microbatches = spec.packing.phase_at(0)  # the phase's (packing.schedule)
        self.capacity = self.seq_len
        # cursors, deficits and drawing (planning/draws.py); longest chunk per source (max_chunk)
        self.draws = SourceDraws(spec, provider, phases.chunk_limits(spec, self.seq_len))
        self.costs = StepCosts(spec)  # item costs per CP rank, outliers, the step's cost figures
        self.images = spec.images is not None  # an encoder load (patches) and the encoder's cost
        # context_parallel: dynamic -- degrees and waves over the dp x cp pool (planning/dynamic_cp.py)
        self.dcp = DynamicCP(spec, self.ranks) if spec.context_parallel.mode == "dynamic" else None
        self.weights = RunWeights(spec)  # the spec's schedule, run-time overrides, online policy
        self.mixture = self.weights.schedule
        self.step = 0
        self.delivered_tokens = 0  # tokens and samples (chunks) placed in the steps planned so far
        self.delivered_samples = 0
        self.carry = Items.empty()
        # what decides the sources' order : what decides their shares (a resume checks both)
        self.fingerprint = f"{spec.data_fingerprint()}:{spec.mixture_fingerprint()}"
        self.source_fingerprints = [spec.source_fingerprint(n) for n in spec.source_names]
        self.parked: dict = {}  # sources a spec change removed: cursor, deficit, carried chunks
        self.resume_changes: list[str] = []  # what the last allow_spec_change resume found changed

    # The reading position lives in `draws`; these are the Planner's views of its arrays (tests and metrics
    # read them). They have no setters: `self.deficit += x` would rebind, so updates go through `self.draws`.
    @property
    def provider(self) -> MetadataProvider:
        return self.draws.provider

    @provider.setter
    def provider(self, provider: MetadataProvider) -> None:
        self.draws.provider = provider

    @property
    def cursor(self) -> np.ndarray:
        """[sources, 5]: epoch, file_pos, block_pos, position, offset (tokens of that document drawn)."""
        return self.draws.cursor

    @property
    def deficit(self) -> np.ndarray:
        return self.draws.deficit

    @property
    def drawn(self) -> np.ndarray:
        return self.draws.drawn

    def draw(self, source: int) -> Items:
        """Take chunks from one source while the next chunk starts before its deficit is used up
        (SourceDraws.draw)."""
        return self.draws.draw(source, self.step)

    def _draw_sources(self) -> Items:
        """One draw from every source, in source order, through `draw` (what a test may watch)."""
        return Items.concat([self.draw(i) for i in range(len(self.spec.sources))])

    # ----- the algorithm -----------------------------------------------------------------------
    def plan_step(self) -> StepPlan:
        state_before = self.state_dict()
        drawn_before = self.drawn.copy()
        self.draws.empty_docs = 0
        self._enter_phase()
        step_capacity = self.ranks * self.microbatches * self.capacity
        carry_tokens = int(self.carry.length.sum())
        budget = max(0, step_capacity - carry_tokens)
        weights = self.weights.at(self.step, self.delivered_tokens)
        if self.mixture.windowed:  # a source outside its window draws nothing: drop its leftover quota
            off = ~self.mixture.active(self.step)
            self.deficit[off] = np.minimum(self.deficit[off], 0.0)
        self.draws.deficit += weights * budget
        new = self._draw_sources()
        items = Items.concat([self.carry, new])
        priority = np.concatenate([self.carry.delayed + 1, np.zeros(len(new), dtype=np.int64)])
        held = self.costs.held_outliers(items, self.ranks)
        if held.any():
            # Held outliers wait in the carry; the mixture tops the step up with as many tokens.
            topup = int(items.length[held].sum())
            self.draws.deficit += weights * topup
            extra = self._draw_sources()
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
        if self.dcp is not None:
            context = {"state_before": state_before, "drawn_before": drawn_before, "weights": weights}
            return finish_step(self, items, priority, outliers, context)
        # Per-GPU cost: with context parallelism each CP rank of a replica carries cost / cp.
        costs, encoder = self.costs.of(items)
        loads, load_capacity = self.costs.encoder_loads(items)
        result = balance.assign(
            items.length, costs, ranks=self.ranks, microbatches=self.microbatches, capacity=self.capacity,
            priority=priority, mode=self.spec.balance.mode, loads=loads, load_capacity=load_capacity,
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
            empty_documents=self.draws.empty_docs,
            state_before=state_before,
            rank_microbatches=result.microbatches,
            vocab_size=self.spec.vocab_size,
            label_horizon=self.spec.packing.label_horizon,
            weights=weights,
            drawn=self.drawn - drawn_before,
        )
        plan.max_over_capacity_lb = self.costs.capacity_certificate(result, items, costs, step=self.step,
                                                                    capacity=self.capacity)
        if self.images or self.spec.audio is not None:  # media figures: encoder cost, placeholder labels
            plan.images = self.costs.image_stats(result, items, encoder, costs, placed)
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
        self.draws.limits = phases.chunk_limits(self.spec, self.seq_len) if self.dcp is None \
            else self.dcp.chunk_limits(self.seq_len)
        self.carry = phases.recut(self.carry, self.draws.limits, self.draws.grains)

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
            self.draws.deficit += weights * short
            extra = self._draw_sources()
            n = len(items)
            items = Items.concat([items, extra])
            costs = np.concatenate([costs, self.costs.of(extra)[0]])
            priority = np.concatenate([priority, np.zeros(len(extra), dtype=np.int64)])
            left = np.concatenate([left, np.arange(n, len(items))])
            short -= int(extra.length.sum())
        order = left[np.lexsort((left, -priority[left]))]
        cap = self.spec.packing.max_long_per_step
        longest = cap.min_tokens - 1 if cap is not None else None  # a piece never counts as a long chunk
        pieces, ranks, micros, piece_costs, rest, cut = phases.fill_boundary(
            result, items, order, self.capacity, self.costs.of_tokens, longest)
        placed = (Items.concat([out[0], pieces]), np.concatenate([out[1], piece_costs]),
                  np.concatenate([out[2], ranks]), np.concatenate([out[3], micros]))
        return placed, rest, cut

    # ----- data state --------------------------------------------------------------------------
    def live_blocks(self) -> set[tuple[int, int, int, int]]:
        """Blocks that the Planner will still read from (its cursors) or that hold carried chunks."""
        live = self.draws.cursor_blocks()
        live.update(self.carry.block_keys()[0])
        return live

    def state_dict(self) -> dict:
        state = {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint,
            "step": self.step,
            "sources": self.draws.source_states(self.source_fingerprints),
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
        self.draws.load_source_states(state["sources"])
        self.carry = Items.from_rows(state["carry"])
        self.weights.load(state)
        self.parked = copy.deepcopy(state.get("parked") or {})
        delivered = state.get("delivered") or {"tokens": 0, "samples": 0}
        self.delivered_tokens, self.delivered_samples = int(delivered["tokens"]), int(delivered["samples"])
        self.draws.check_cursors()
        # The state is layout-free, with one limit: carried chunks were cut for the saved seq_len and
        # must still fit a micro-batch, or they could never be delivered.
        if not self.spec.packing.schedule and self.dcp is None and len(self.carry) \
                and int(self.carry.length.max()) > self.capacity:
            raise PlaitError(
                f"the data state carries chunks of up to {int(self.carry.length.max())} tokens, more than this "
                f"layout's micro-batch capacity ({self.capacity}); resume with seq_len >= that"
            )
        self.resume_changes = changes
        return changes
