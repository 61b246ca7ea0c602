"""The declarative spec: typed models, YAML/dict loading, validation.

A spec fully describes the data a job sees: its sources, the mixture (and its schedule over steps),
how documents are packed, the job's parallel layout, the cost model that balancing minimises, and the
seed. Together with the data it fixes the stream of batches: nothing else does.

Every model forbids unknown fields, so a typo fails at load time with the field's path.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from plait.errors import SpecError

Format = Literal["parquet", "jsonl"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Model):
    """One data source: a set of files (shards) of one format."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="unique name, used in metrics and state")
    path: str | list[str] = Field(description="a path, glob or fsspec URL, or a list of them")
    format: Format | None = Field(None, description="parquet or jsonl; inferred from the file extension")
    text_field: str | None = Field(None, description="the text column/key, tokenized on read")
    tokens_field: str | None = Field(None, description="a pre-tokenized list<int> column/key")
    tokenizer: str | None = Field(None, description="path of a Hugging Face tokenizer.json; bytes if unset")
    bos: int | None = Field(None, ge=0, le=2**31 - 1, description="token id prepended to each document")
    eos: int | None = Field(None, ge=0, le=2**31 - 1, description="token id appended to each document")
    weight: float = Field(1.0, ge=0, description="token share in the mixture (normalised over sources)")
    on_error: Literal["raise", "skip"] = Field("raise", description="bad record/shard: stop, or skip and count")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="passed to fsspec")
    shadows: int = Field(
        0, ge=0, description="standby loaders per loader of this source: they follow their primary through "
        "differential checkpoints and take over if it dies, so training does not wait (ray runtime)",
    )

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        formats = get_args(Format)
        if value is not None and value not in formats:
            raise ValueError(f"unknown format {value!r}; supported formats: {', '.join(formats)}")
        return value

    @model_validator(mode="after")
    def _one_field(self) -> "SourceSpec":
        if (self.text_field is None) == (self.tokens_field is None):
            raise ValueError("set exactly one of text_field (raw text) or tokens_field (token ids)")
        if self.tokens_field is not None and self.tokenizer is not None:
            raise ValueError("tokenizer only applies to text_field sources")
        return self

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class SchedulePoint(_Model):
    step: int = Field(ge=0)
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


class MixtureSpec(_Model):
    """Token-share weights over steps. Without a schedule the sources' own weights hold throughout.

    With a schedule, weights are given at steps; between two points they are interpolated linearly
    (`interpolation: linear`) or held (`step`). Sources missing from a point get weight 0 there.
    """

    schedule: list[SchedulePoint] = Field(default_factory=list)
    interpolation: Literal["linear", "step"] = "linear"

    @field_validator("schedule")
    @classmethod
    def _sorted(cls, v: list[SchedulePoint]) -> list[SchedulePoint]:
        steps = [p.step for p in v]
        if steps != sorted(set(steps)):
            raise ValueError("schedule steps must be strictly increasing")
        if v and v[0].step != 0:
            raise ValueError("the schedule must start at step 0")
        return v


class PackingSpec(_Model):
    seq_len: int = Field(4096, ge=8, description="token capacity of one packed micro-batch (per DP replica)")
    microbatches: int | None = Field(None, ge=1, description="micro-batches per DP rank per step")
    tokens_per_rank: int | None = Field(None, ge=8, description="alternative: tokens per DP rank per step")
    split_long: Literal["chunk"] = Field(
        "chunk", description="documents longer than seq_len are cut into seq_len chunks"
    )

    @model_validator(mode="after")
    def _one_size(self) -> "PackingSpec":
        if self.microbatches is not None and self.tokens_per_rank is not None:
            raise ValueError("set microbatches or tokens_per_rank, not both")
        if self.tokens_per_rank is not None and self.tokens_per_rank < self.seq_len:
            raise ValueError("tokens_per_rank must be at least seq_len")
        return self

    @property
    def num_microbatches(self) -> int:
        if self.tokens_per_rank is not None:
            return self.tokens_per_rank // self.seq_len
        return self.microbatches or 1


class TopologySpec(_Model):
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


class CostSpec(_Model):
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

    @model_validator(mode="after")
    def _coeffs(self) -> "CostSpec":
        if (self.linear is None) != (self.quadratic is None):
            raise ValueError("give both linear and quadratic, or neither (then model dimensions are used)")
        if self.kv_heads is not None and self.heads is not None and self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        return self


class BalanceSpec(_Model):
    mode: Literal["equal", "variable"] = Field(
        "equal", description="equal: every rank gets the same number of micro-batches; variable: not"
    )
    max_delay: int = Field(0, ge=0, description="steps an outlier document may be delayed (0: never)")
    outlier_factor: float = Field(1.0, gt=0, description="delay documents costing more than this x mean rank load")


class MetricsSpec(_Model):
    """Prometheus metrics (plait.telemetry): off unless a port is given."""

    port: int | None = Field(None, ge=0, le=65535, description="serve /metrics here (0: any free port)")
    address: str = Field("127.0.0.1", description="the interface to serve on (loopback by default)")


class Spec(_Model):
    """A whole job's data description."""

    sources: list[SourceSpec] = Field(min_length=1)
    mixture: MixtureSpec = Field(default_factory=MixtureSpec)
    packing: PackingSpec = Field(default_factory=PackingSpec)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    balance: BalanceSpec = Field(default_factory=BalanceSpec)
    seed: int = 0
    steps: int | None = Field(None, ge=1, description="stop after this many global steps (unbounded if unset)")
    vocab_size: int | None = Field(None, ge=1, description="the model's vocabulary: a token id >= it is a bad record")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)

    # Cross-field checks live on the field they are about, so that SpecError names that field.
    @field_validator("sources")
    @classmethod
    def _unique_names(cls, v: list[SourceSpec]) -> list[SourceSpec]:
        names = [s.name for s in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique (repeated: {dup})")
        return v

    @field_validator("mixture")
    @classmethod
    def _known_sources(cls, v: MixtureSpec, info: ValidationInfo) -> MixtureSpec:
        sources = info.data.get("sources")
        if sources is None:  # sources invalid: already reported
            return v
        names = {s.name for s in sources}
        for i, point in enumerate(v.schedule):
            unknown = sorted(set(point.weights) - names)
            if unknown:
                raise ValueError(f"schedule[{i}] names unknown sources {unknown} (sources: {sorted(names)})")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> "Spec":
        if not self.mixture.schedule and sum(s.weight for s in self.sources) <= 0:
            raise ValueError("at least one source needs a positive weight")
        return self

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def data_fingerprint(self) -> str:
        """Digest of everything that decides which samples come in which order (not the layout)."""
        core = self.model_dump(mode="json", include={"sources", "mixture", "seed"})
        for s in core["sources"]:
            s.pop("on_error", None)
            s.pop("storage_options", None)
            s.pop("shadows", None)
        if self.vocab_size is not None:  # it decides which records are delivered (only when set: old
            core["vocab_size"] = self.vocab_size  # states keep their fingerprint)
        return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]

    def with_overrides(self, **changes: Any) -> "Spec":
        """A copy with top-level sections replaced (e.g. topology={'dp': 4}), re-validated."""
        data = self.model_dump(mode="python")
        for key, value in changes.items():
            if isinstance(value, BaseModel):
                value = value.model_dump(mode="python")
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return load_spec(data)


def _format_location(loc: tuple[Any, ...], data: Any) -> str:
    """Turn pydantic's location into a readable path, naming sources by their name."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            name = None
            if isinstance(node, list) and 0 <= item < len(node) and isinstance(node[item], dict):
                name = node[item].get("name")
            label = f"[{item}]" + (f"({name})" if name else "")
            if parts:
                parts[-1] += label
            else:
                parts.append(label)
        else:
            parts.append(str(item))
        try:
            node = node[item]
        except (KeyError, IndexError, TypeError):
            node = None
    return ".".join(parts) or "<spec>"


def load_spec(source: str | os.PathLike | dict | Spec, *, base_dir: str | None = None) -> Spec:
    """Load and validate a spec from a YAML/JSON file, a YAML string path or a dict.

    Relative source paths in a file are resolved against the file's folder.
    """
    if isinstance(source, Spec):
        return source
    origin = None
    if isinstance(source, dict):
        data = source
    elif not isinstance(source, (str, os.PathLike)):
        raise SpecError([("<spec>", f"a spec must be a mapping or a file path, not {type(source).__name__}")])
    else:
        origin = str(source)
        path = Path(source)
        if not path.exists():
            raise SpecError([("<file>", f"no such spec file: {path}")], origin)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise SpecError([("<file>", f"not valid YAML: {e}")], origin) from None
        except (OSError, UnicodeDecodeError) as e:  # a folder, no permission, binary file
            raise SpecError([("<file>", f"cannot read: {type(e).__name__}: {e}")], origin) from None
        base_dir = base_dir or str(path.parent.resolve())
        if not isinstance(data, dict):
            raise SpecError([("<file>", "the spec must be a mapping at the top level")], origin)
    if base_dir:
        data = _resolve_paths(data, base_dir)
    try:
        return Spec.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            problems.append((_format_location(err["loc"], data), msg))
        raise SpecError(problems, origin) from None


def _is_url(path: str) -> bool:
    return "://" in path


def _resolve_paths(data: dict, base_dir: str) -> dict:
    data = dict(data)
    sources = data.get("sources")
    if not isinstance(sources, list):
        return data
    out = []
    for src in sources:
        if isinstance(src, dict):
            src = dict(src)
            for key in ("path", "tokenizer"):
                val = src.get(key)
                if isinstance(val, str) and not _is_url(val) and not os.path.isabs(val):
                    src[key] = os.path.join(base_dir, val)
                elif isinstance(val, list) and key == "path":
                    src[key] = [
                        v if (not isinstance(v, str) or _is_url(v) or os.path.isabs(v)) else os.path.join(base_dir, v)
                        for v in val
                    ]
        out.append(src)
    data["sources"] = out
    return data
