"""The spec's sections apart from its sources: mixture and schedule, packing, topology, cost model,
encoder, images, balance, loading and metrics (plait.spec assembles them into a Spec).

Every model forbids unknown fields, so a typo fails at load time with the field's path.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class StrictModel(BaseModel):
    """A spec model: unknown fields are refused, values are frozen. Validators are built at the first
    validation (defer_build): a process that only receives specs (a Ray actor, a trainer) never builds them,
    ~55 ms of CPU less at each start."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class SchedulePoint(StrictModel):
    step: int | None = Field(None, ge=0, description="where the point is (schedule_by: step)")
    tokens: int | None = Field(None, ge=0, description="where the point is (schedule_by: tokens): tokens delivered")
    weights: dict[str, float]

    @field_validator("weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k, w in v.items() if w < 0]
        if bad:
            raise ValueError(f"weights must be >= 0 (got negative for {bad})")
        if sum(v.values()) <= 0:
            raise ValueError("at least one weight must be positive")
        return v


class OnlineSpec(StrictModel):
    """Online mixing: the trainer reports per-source losses (`Loader.report`), a policy updates the weights.

    The update for the window of steps [wK, (w+1)K) uses the reports of its steps and takes effect at
    step (w+1)K - 1 + delay, whatever the timing: a report for step s arriving after step s + delay was
    planned is refused. `delay` must therefore exceed how far the loader plans ahead of the trainer
    (its prefetch depth plus one).
    """

    policy: Literal["exp_gradient"] = "exp_gradient"
    every: int = Field(100, ge=1, description="K: steps per update window")
    lr: float = Field(1.0, gt=0, description="eta: w_i <- w_i * exp(eta * excess_loss_i)")
    floor: float = Field(0.05, ge=0, lt=1, description="epsilon: w <- (1 - epsilon) w + epsilon / n")
    delay: int = Field(4, ge=1, description="steps between a window's last step and its update")
    reference: dict[str, float] = Field(
        default_factory=dict, description="per-source reference loss subtracted from the reported one (default 0)",
    )


class MixtureSpec(StrictModel):
    """Token-share weights over steps. Without a schedule the sources' own weights hold throughout.

    With a schedule, weights are given at steps (`schedule_by: step`) or at numbers of tokens delivered
    (`schedule_by: tokens`, points with `tokens:`); between two points they are interpolated linearly
    (`interpolation: linear`), along a half cosine (`cosine`) or held (`step`). Sources missing from a
    point get weight 0 there.
    """

    schedule_by: Literal["step", "tokens"] = "step"  # before `schedule`: its validator reads it
    schedule: list[SchedulePoint] = Field(default_factory=list)
    interpolation: Literal["linear", "step", "cosine"] = "linear"
    online: OnlineSpec | None = None

    @field_validator("schedule")
    @classmethod
    def _sorted(cls, v: list[SchedulePoint], info: ValidationInfo) -> list[SchedulePoint]:
        by = info.data.get("schedule_by", "step")
        key = "tokens" if by == "tokens" else "step"
        other = "step" if key == "tokens" else "tokens"
        if any(getattr(p, key) is None for p in v):
            raise ValueError(f"schedule_by: {by}: every schedule point needs `{key}:`")
        if any(getattr(p, other) is not None for p in v):
            raise ValueError(f"schedule_by: {by}: schedule points give `{key}:`, not `{other}:`")
        at = [getattr(p, key) for p in v]
        if at != sorted(set(at)):
            raise ValueError(f"schedule {key}s must be strictly increasing")
        if v and at[0] != 0:
            raise ValueError(f"the schedule must start at {key} 0")
        return v


class PackingPhase(StrictModel):
    """One sequence-length phase: from `step` on, micro-batches of `seq_len` tokens, `microbatches` per rank."""

    step: int = Field(ge=0)
    seq_len: int = Field(ge=8)
    microbatches: int | None = Field(None, ge=1, description="unset: the packing section's")


class LongCap(StrictModel):
    """At most `per_rank` chunks of at least `min_tokens` tokens per DP rank per step."""

    min_tokens: int = Field(ge=1)
    per_rank: int = Field(ge=1)


class PackingSpec(StrictModel):
    seq_len: int = Field(4096, ge=8, description="token capacity of one packed micro-batch (per DP replica)")
    microbatches: int | None = Field(None, ge=1, description="micro-batches per DP rank per step")
    tokens_per_rank: int | None = Field(None, ge=8, description="alternative: tokens per DP rank per step")
    split_long: Literal["chunk"] = Field(
        "chunk", description="documents longer than seq_len are cut into seq_len chunks"
    )
    max_patches: int | None = Field(
        None, ge=1, description="image patches one micro-batch may hold (the encoder's capacity); unset: no limit",
    )
    max_audio_positions: int | None = Field(
        None, ge=1, description="audio encoder positions one micro-batch may hold (the audio encoder's capacity: "
        "the sum of its clips' attention spans, 1,500 per 30 s window for Whisper's encoder); unset: no limit",
    )
    label_horizon: int = Field(
        1, ge=1, le=64, description="multi-token prediction: batches carry `mtp_labels` [k, tokens] when k > 1",
    )
    schedule: list[PackingPhase] | None = Field(
        None, description="sequence-length phases [{step, seq_len, microbatches}], steps strictly increasing from "
        "0; then seq_len and microbatches above are the largest of the phases'",
    )
    split: Literal["none", "boundary"] = Field(
        "none", description="boundary: cut a document at a micro-batch's end to fill it (the rest follows as "
        "its own sequence)",
    )
    max_long_per_step: LongCap | None = Field(
        None, description="at most per_rank chunks of >= min_tokens tokens per DP rank per step (the rest waits)",
    )

    @model_validator(mode="after")
    def _one_size(self) -> "PackingSpec":
        if self.microbatches is not None and self.tokens_per_rank is not None:
            raise ValueError("set microbatches or tokens_per_rank, not both")
        if self.schedule:
            steps = [p.step for p in self.schedule]
            if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
                raise ValueError("packing.schedule: steps must start at 0 and strictly increase")
            for p in self.schedule:  # a phase without microbatches takes the section's
                if p.microbatches is None:
                    mb = (self.tokens_per_rank // p.seq_len) if self.tokens_per_rank else (self.microbatches or 1)
                    object.__setattr__(p, "microbatches", mb)  # frozen model: set once, while validating
                    if mb < 1:
                        raise ValueError(f"packing.schedule: tokens_per_rank is below the phase's seq_len {p.seq_len}")
            # the section's own values become the largest phase's (what sizes buffers and bounds checks)
            object.__setattr__(self, "seq_len", max(p.seq_len for p in self.schedule))
            object.__setattr__(self, "microbatches", max(int(p.microbatches) for p in self.schedule))
            object.__setattr__(self, "tokens_per_rank", None)
        if self.tokens_per_rank is not None and self.tokens_per_rank < self.seq_len:
            raise ValueError("tokens_per_rank must be at least seq_len")
        return self

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per rank per step (with a schedule: the most of any phase)."""
        if self.tokens_per_rank is not None:
            return self.tokens_per_rank // self.seq_len
        return self.microbatches or 1

    def phase_at(self, step: int) -> tuple[int, int]:
        """(seq_len, microbatches) of the phase holding `step` (the section's when there is no schedule)."""
        if not self.schedule:
            return self.seq_len, self.num_microbatches
        phase = [p for p in self.schedule if p.step <= step][-1]
        return phase.seq_len, int(phase.microbatches)

    def min_seq_len(self) -> int:
        return min(p.seq_len for p in self.schedule) if self.schedule else self.seq_len


class TopologySpec(StrictModel):
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class InterconnectSpec(StrictModel):
    """What prices context-parallel traffic (dynamic CP): keys and values passed around a group's ring once
    per layer, forward and backward (plait.cost.CommCost). Bandwidths in GB/s (gigabytes) per rank."""

    bandwidth_gbps: float = Field(450.0, gt=0, description="GB/s per rank inside a node (NVLink)")
    inter_node_bandwidth_gbps: float = Field(50.0, gt=0, description="GB/s per rank between nodes (400 Gb/s IB)")
    latency_us: float = Field(10.0, ge=0, description="latency of one ring pass, microseconds")
    ranks_per_node: int = Field(8, ge=1, description="pool ranks per node: a group beyond one node's pays inter-node")
    compute_tflops: float = Field(400.0, gt=0, description="achieved TFLOP/s: turns seconds of traffic into the "
                                  "cost model's FLOPs (a cost model fitted in seconds: 1e-12)")
    kv_bytes: int = Field(2, ge=1, description="bytes per key/value element (bf16: 2)")


class CostSpec(StrictModel):
    """The per-document cost c(L) = linear*L + quadratic*L^2.

    Give model dimensions (the coefficients follow from the FLOP count of a decoder layer), or
    explicit coefficients. Defaults: a 7B Llama-like model.
    """

    hidden: int | None = Field(4096, ge=1)
    layers: int | None = Field(32, ge=1)
    ffn: int | None = Field(11008, ge=1)
    heads: int | None = Field(32, ge=1)
    kv_heads: int | None = Field(None, ge=1, description="KV groups (GQA); defaults to heads")
    linear: float | None = Field(None, ge=0)
    quadratic: float | None = Field(None, ge=0)
    attention_tile: int = Field(0, ge=0, description="attention kernel tile: short docs cost as if padded to it")
    encoder: EncoderSpec | None = Field(None, description="the vision encoder's per-image cost (multimodal)")
    interconnect: InterconnectSpec = Field(default_factory=InterconnectSpec, exclude_if=lambda v: v == InterconnectSpec(),
                                           description="prices dynamic CP's traffic (context_parallel.mode: dynamic)")

    @model_validator(mode="after")
    def _coeffs(self) -> "CostSpec":
        if (self.linear is None) != (self.quadratic is None):
            raise ValueError("give both linear and quadratic, or neither (then model dimensions are used)")
        if self.kv_heads is not None and self.heads is not None and self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        return self


class EncoderSpec(StrictModel):
    """The vision encoder's per-image cost e(P) = linear*P + quadratic*P^2 (P: the image's patches): from
    ViT dimensions (hidden, layers, ffn) or explicit coefficients."""

    hidden: int | None = Field(None, ge=1)
    layers: int | None = Field(None, ge=1)
    ffn: int | None = Field(None, ge=1)
    linear: float | None = Field(None, ge=0)
    quadratic: float | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _one_way(self) -> "EncoderSpec":
        dims = [v is not None for v in (self.hidden, self.layers, self.ffn)]
        coeffs = [v is not None for v in (self.linear, self.quadratic)]
        if not ((all(dims) and not any(coeffs)) or (all(coeffs) and not any(dims))):
            raise ValueError("give either hidden, layers and ffn, or linear and quadratic")
        return self


class ImagesSpec(StrictModel):
    """How images become patches and placeholder tokens (plait.media.image_policy.ImagePolicy)."""

    policy: Literal["dynamic", "tiles"] = Field("dynamic", description="dynamic (Qwen2-VL) or tiles (InternVL)")
    patch: int = Field(14, ge=1, description="ViT patch side in pixels")
    merge: int = Field(2, ge=1, description="merge x merge patches become one LLM token")
    min_pixels: int = Field(56 * 56, ge=1)
    max_pixels: int = Field(28 * 28 * 1280, ge=1)
    tile: int = Field(448, ge=1)
    min_tiles: int = Field(1, ge=1)
    max_tiles: int = Field(12, ge=1)
    thumbnail: bool = True
    fast_jpeg: bool = Field(False, description="JPEG draft decoding: faster, not the reference processor's pixels")
    image_token_id: int = Field(ge=0, le=2**31 - 1, description="the placeholder id images occupy in input_ids")

    @model_validator(mode="after")
    def _consistent(self) -> "ImagesSpec":
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must be at most max_pixels")
        if self.min_tiles > self.max_tiles:
            raise ValueError("min_tiles must be at most max_tiles")
        if self.tile % (self.patch * self.merge):
            raise ValueError(f"tile {self.tile} must be a multiple of patch * merge = {self.patch * self.merge}")
        return self


class BalanceSpec(StrictModel):
    mode: Literal["equal", "variable"] = Field(
        "equal", description="equal: every rank gets the same number of micro-batches; variable: not"
    )
    max_delay: int = Field(0, ge=0, description="steps an outlier document may be delayed (0: never)")
    outlier_factor: float = Field(1.0, gt=0, description="delay documents costing more than this x mean rank load")


class ContextParallelSpec(StrictModel):
    """How documents are sharded for context parallelism over the pool of dp x cp ranks (docs/long-context.md).

    fixed: every document of a replica's micro-batch is sharded over the replica's cp ranks (the default).
    dynamic: each document gets a CP degree by its cost, the Planner groups ranks from the vocabulary the
    trainer pre-creates (pow2: aligned power-of-two blocks; contiguous: any run of ranks) and plans the step
    in waves."""

    mode: Literal["fixed", "dynamic"] = "fixed"
    groups: Literal["pow2", "contiguous"] = Field("pow2", description="the group vocabulary the trainer pre-creates")
    max_degree: int | None = Field(None, ge=1, description="largest group (default: the pool, a power of two for pow2)")
    theta: float = Field(1.0, gt=0, description="a document's degree: its cost over theta x the mean rank cost")

    @model_validator(mode="after")
    def _pow2(self) -> "ContextParallelSpec":
        if self.groups == "pow2" and self.max_degree is not None and self.max_degree & (self.max_degree - 1):
            raise ValueError(f"max_degree {self.max_degree} is not a power of two (groups: pow2)")
        return self

    def degree_cap(self, pool: int) -> int:
        """The largest group of a pool of `pool` ranks."""
        cap = min(pool, self.max_degree or pool)
        return 1 << (cap.bit_length() - 1) if self.groups == "pow2" else cap


class LoadingSpec(StrictModel):
    """How much decoded data the job's SourceLoaders may hold (besides each source's `buffer_mb`)."""

    max_buffer_mb: float | None = Field(512, gt=0, description="cap on the decoded data one SourceLoader holds over "
                                        "all its sources, MiB (local: per process; ray: split over the loader actors "
                                        "by their share of the sources); null: only the sources' buffer_mb")
    max_open_streams: int | None = Field(16, ge=1, description="row groups read in row ranges keep a reader open "
                                         "between pieces (its data page and dictionary, ~1 MiB); one SourceLoader "
                                         "keeps at most this many, least recently used closed first (a closed one "
                                         "is read up to its piece again: decode time, not memory); null: no limit")
    workers: Literal["auto"] | Annotated[int, Field(ge=1)] = Field("auto", description="threads a SourceLoader decodes images on (same batches for any number); auto: the CPUs left after the trainers")


class MetricsSpec(StrictModel):
    """Prometheus metrics (plait.telemetry): off unless a port is given."""

    port: int | None = Field(None, ge=0, le=65535, description="serve /metrics here (0: any free port)")
    address: str = Field("127.0.0.1", description="the interface to serve on (loopback by default)")
