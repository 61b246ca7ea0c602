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
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from plait.errors import SpecError, field_path
from plait.spec_sections import (  # noqa: F401 - the sections are this module's API too
    StrictModel,
    SchedulePoint,
    OnlineSpec,
    MixtureSpec,
    PackingPhase,
    LongCap,
    PackingSpec,
    TopologySpec,
    CostSpec,
    EncoderSpec,
    ImagesSpec,
    BalanceSpec,
    ContextParallelSpec,
    InterconnectSpec,
    LoadingSpec,
    MetricsSpec,
)
from plait.audio_spec import AUDIO_FIELD_HELP, AudioSpec, audio_used, check_audio_field
from plait.video_spec import VIDEO_FIELD_HELP, VideosSpec, check_video_field, videos_used

Format = Literal["parquet", "jsonl", "megatron", "arrow", "mds", "webdataset"]
IMAGE_FORMATS = ("parquet", "jsonl", "webdataset")  # formats that read an image_field
DEFAULT_BUFFER_MB = 16.0  # a source's decoded-data budget when its buffer_mb is unset
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")  # webdataset image members


_Model = StrictModel  # every spec model forbids unknown fields


class SourceSpec(_Model):
    """One data source: a set of files (shards) of one format."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="unique name, used in metrics and state")
    path: str | list[str] = Field(
        description="a path, glob or fsspec URL, or a list of them. megatron: the prefix of a .bin/.idx pair "
        "(corpus_text_document), a folder of pairs, or a list of prefixes; mds: a folder holding index.json; "
        "arrow: .arrow files or a `save_to_disk` folder",
    )
    format: Format | None = Field(
        None, description="parquet, jsonl, megatron, arrow or mds; inferred from the file names when unset",
    )
    text_field: str | None = Field(None, description="the text column/key, tokenized on read")
    tokens_field: str | None = Field(
        None, description="a pre-tokenized list<int> column/key (megatron: the sequences; the name is free)",
    )
    length_field: str | None = Field(
        None, description="a stored integer column/key holding each record's token count (without bos/eos): "
        "planning then reads only it, and the tokens are read when a payload is gathered (megatron's index, "
        "and mds's offsets where the token column is the only variable one, give lengths without it)",
    )
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
    start_step: int | None = Field(None, ge=0, description="the source is drawn from this step on (weight 0 before)")
    stop_step: int | None = Field(None, ge=1, description="the source is not drawn from this step on (weight 0)")
    image_field: str | None = Field(
        None, description="the sample's image(s): webdataset: member extensions ('jpg;png;webp'); parquet: a "
        "column of struct<bytes, path>, binary, or a list of them; jsonl/json (LLaVA): a key holding an image "
        "path or a list of paths (relative to image_root). Needs the top-level `images` section",
    )
    image_root: str | None = Field(None, description="the folder image paths are relative to (LLaVA)")
    video_field: str | None = Field(None, description=VIDEO_FIELD_HELP, exclude_if=lambda v: v is None)
    audio_field: str | None = Field(None, description=AUDIO_FIELD_HELP, exclude_if=lambda v: v is None)
    max_chunk: int | None = Field(
        None, ge=8, description="longest chunk of this source: its documents are cut into chunks of at most "
        "min(max_chunk, seq_len) tokens", exclude_if=lambda v: v is None,  # unset: fingerprints as before
    )
    template: Literal["caption", "chat"] | None = Field(
        None, description="caption: [image placeholders] + text + eos; chat: a LLaVA conversation list "
        "[{from|role, value|content}] whose `<image>` markers become placeholder runs (default caption)",
    )
    buffer_mb: float | None = Field(
        None, gt=0, description=f"decoded data a SourceLoader keeps of this source, in MiB (default "
        f"{DEFAULT_BUFFER_MB:g}); a Parquet row group decoding to more than a quarter of it is read in row ranges "
        "(which changes the order of that row group's rows: set it when you create a job, not mid-run)",
        exclude_if=lambda v: v is None,  # unset: fingerprints as before
    )
    placeholder_ids: Literal["refuse", "replace"] | None = Field(
        None, description="media placeholder ids (images.image_token_id, videos.video_token_id) in a document "
        "without media, which a vision-language model's forward takes for media positions: unset, counted "
        "(error_report's placeholder_documents) and warned about; refuse: such a document is a bad record "
        "(on_error decides); replace: each such id becomes placeholder_replacement",
        exclude_if=lambda v: v is None,  # unset: fingerprints as before
    )
    placeholder_replacement: int | None = Field(
        None, ge=0, le=2**31 - 1, description="the id that replaces them under placeholder_ids: replace (an id "
        "the model embeds as text, e.g. the tokenizer's pad)", exclude_if=lambda v: v is None,
    )

    buffer_bytes = property(lambda self: int((self.buffer_mb or DEFAULT_BUFFER_MB) * 2**20))

    @field_validator("format", mode="before")
    @classmethod
    def _known_format(cls, value: Any) -> Any:
        formats = get_args(Format)
        if value is not None and value not in formats:
            raise ValueError(f"unknown format {value!r}; supported formats: {', '.join(formats)}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _megatron_tokens(cls, data: Any) -> Any:
        # A Megatron .bin holds token ids and nothing else: the field needs no name.
        if isinstance(data, dict) and data.get("format") == "megatron" and "tokens_field" not in data \
                and "text_field" not in data:
            data = {**data, "tokens_field": "tokens"}
        return data

    @model_validator(mode="after")
    def _one_field(self) -> "SourceSpec":
        if self.format == "megatron" and self.text_field is not None:
            raise ValueError("megatron files hold token ids, not text: set tokens_field (or neither)")
        if self.format == "megatron" and self.length_field is not None:
            raise ValueError("megatron's index holds every sequence's length: length_field does not apply")
        if (self.text_field is None) == (self.tokens_field is None):
            raise ValueError("set exactly one of text_field (raw text) or tokens_field (token ids)")
        if self.tokens_field is not None and self.tokenizer is not None:
            raise ValueError("tokenizer only applies to text_field sources")
        if self.start_step is not None and self.stop_step is not None and self.stop_step <= self.start_step:
            raise ValueError("stop_step must be after start_step")
        if (self.placeholder_ids == "replace") != (self.placeholder_replacement is not None):
            raise ValueError("placeholder_ids: replace takes placeholder_replacement (the id to put instead), and "
                             "placeholder_replacement only applies with it")
        self._image_checks()
        return self

    def _image_checks(self) -> None:
        if self.video_field is not None:
            check_video_field(self)
        if self.audio_field is not None:
            check_audio_field(self)
        if self.image_field is None and (self.video_field is not None or self.audio_field is not None):
            return
        if self.image_field is None:
            if self.image_root is not None or self.template is not None:
                raise ValueError("image_root and template apply to image sources only: set image_field")
            if self.format == "webdataset":
                raise ValueError("a webdataset source needs image_field or audio_field (its media members' extensions)")
            return
        if self.format is not None and self.format not in IMAGE_FORMATS:
            raise ValueError(f"image_field: format {self.format} holds no images (image formats: {', '.join(IMAGE_FORMATS)})")
        if self.text_field is None:
            raise ValueError("image_field: an image source needs text_field (text is tokenized around the images)")
        if self.length_field is not None:
            raise ValueError("image_field: length_field does not apply (placeholder counts come from image headers)")
        if self.format == "webdataset":
            bad = [e for e in self.image_extensions if e not in IMAGE_EXTENSIONS]
            if bad or not self.image_extensions:
                raise ValueError(f"image_field: unknown image extension(s) {bad} (known: {', '.join(IMAGE_EXTENSIONS)})")

    multimodal = property(lambda self: any(f is not None for f in (self.image_field, self.video_field, self.audio_field)))

    @property
    def image_extensions(self) -> list[str]:
        """webdataset: the image members' extensions, lower case, in the order given."""
        return [e.strip().lower().lstrip(".") for e in (self.image_field or "").split(";") if e.strip()]

    video_extensions = property(lambda self: [e.strip().lower().lstrip(".") for e in (self.video_field or "").split(";")
                                              if e.strip()])  # webdataset: the video members' extensions
    audio_extensions = property(lambda self: [e.strip().lower().lstrip(".") for e in (self.audio_field or "").split(";")
                                              if e.strip()])  # webdataset: the audio members' extensions

    @property
    def paths(self) -> list[str]:
        return [self.path] if isinstance(self.path, str) else list(self.path)


class Spec(_Model):
    """A whole job's data description."""

    sources: list[SourceSpec] = Field(min_length=1)
    mixture: MixtureSpec = Field(default_factory=MixtureSpec)
    packing: PackingSpec = Field(default_factory=PackingSpec)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    balance: BalanceSpec = Field(default_factory=BalanceSpec)
    context_parallel: ContextParallelSpec = Field(default_factory=ContextParallelSpec,
                                                  exclude_if=lambda v: v == ContextParallelSpec())
    seed: int = 0
    steps: int | None = Field(None, ge=1, description="stop after this many global steps (unbounded if unset)")
    vocab_size: int | None = Field(None, ge=1, description="the model's vocabulary: a token id >= it is a bad record")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)
    loading: LoadingSpec = Field(default_factory=LoadingSpec)
    images: ImagesSpec | None = Field(None, description="image policy and placeholder id, for image sources")
    videos: VideosSpec | None = Field(None, description="video frame rule and placeholder id, for video sources",
                                      validate_default=True, exclude_if=lambda v: v is None)
    audio: AudioSpec | None = Field(None, description="audio window policy, placeholder id and encoder cost, for audio "
                                    "sources", validate_default=True, exclude_if=lambda v: v is None)

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
        unknown = sorted(set(v.online.reference) - names) if v.online is not None else []
        if unknown:
            raise ValueError(f"online.reference names unknown sources {unknown} (sources: {sorted(names)})")
        return v

    @model_validator(mode="after")
    def _cross_checks(self) -> "Spec":
        if not self.mixture.schedule and sum(s.weight for s in self.sources) <= 0:
            raise ValueError("at least one source needs a positive weight")
        return self

    @field_validator("context_parallel")
    @classmethod
    def _dynamic_fits(cls, v: ContextParallelSpec, info: ValidationInfo) -> ContextParallelSpec:
        topology, packing, balance = (info.data.get(k) for k in ("topology", "packing", "balance"))
        if v.mode == "fixed" or topology is None or packing is None or balance is None:
            return v
        pool = topology.dp * topology.cp
        if v.max_degree is not None and v.max_degree > pool:
            raise ValueError(f"max_degree {v.max_degree} is larger than the pool of dp x cp = {pool} ranks")
        if v.degree_cap(pool) < topology.cp:
            raise ValueError(f"the largest group ({v.degree_cap(pool)} ranks) is below cp = {topology.cp}: a document "
                             "of seq_len tokens needs cp ranks")
        for seq_len in [p.seq_len for p in packing.schedule or []] or [packing.seq_len]:
            if seq_len % (2 * topology.cp):
                raise ValueError(f"dynamic: seq_len {seq_len} must be a multiple of 2 x cp = {2 * topology.cp} "
                                 "(a rank's slot is seq_len / cp tokens, an even number)")
        if balance.mode != "equal":
            raise ValueError("dynamic: balance.mode must be equal (every rank runs one micro-batch per wave)")
        if packing.split != "none" or packing.max_long_per_step is not None:
            raise ValueError("dynamic: packing.split and packing.max_long_per_step do not apply (the Planner "
                             "gives long documents more ranks instead)")
        return v

    @field_validator("loading")
    @classmethod
    def _cap_holds_a_source(cls, v: LoadingSpec, info: ValidationInfo) -> LoadingSpec:
        largest = max(info.data.get("sources") or [], key=lambda s: s.buffer_bytes, default=None)
        if v.max_buffer_mb is not None and largest is not None and v.max_buffer_mb * 2**20 < largest.buffer_bytes:
            raise ValueError(f"max_buffer_mb {v.max_buffer_mb:g} is below source {largest.name!r}'s buffer_mb "
                             f"({largest.buffer_bytes / 2**20:g}): the job-wide cap must hold at least one source's buffer")
        return v

    @field_validator("images")
    @classmethod
    def _images_used(cls, v: ImagesSpec | None, info: ValidationInfo) -> ImagesSpec | None:
        sources = info.data.get("sources") or []
        needing = [s.name for s in sources if s.image_field is not None]
        if v is None and needing:
            raise ValueError(f"sources {needing} read images: give `images: {{image_token_id: ..., policy: ...}}`")
        vocab = info.data.get("vocab_size")
        if v is not None and vocab is not None and v.image_token_id >= vocab:
            raise ValueError(f"image_token_id {v.image_token_id} is outside the vocabulary (vocab_size {vocab})")
        return v

    @field_validator("videos")
    @classmethod
    def _videos_used(cls, v: VideosSpec | None, info: ValidationInfo) -> VideosSpec | None:
        return videos_used(v, info)

    @field_validator("audio")
    @classmethod
    def _audio_used(cls, v: AudioSpec | None, info: ValidationInfo) -> AudioSpec | None:
        return audio_used(v, info)

    @model_validator(mode="after")
    def _encoder_capacities_need_their_media(self) -> "Spec":
        if self.packing.max_patches is not None and self.images is None:
            raise ValueError("packing.max_patches applies to image sources: give `images:`")
        if self.packing.max_audio_positions is not None and self.audio is None:
            raise ValueError("packing.max_audio_positions applies to audio sources: give a source an audio_field "
                             "and `audio:`")
        return self

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def data_fingerprint(self) -> str:
        """Digest of what decides each source's sample order (sources' data and reading, seed), not the
        mixture (weights may change while a job runs) nor the layout."""
        return _digest({"sources": [self._order_fields(s) for s in self.sources], "seed": self.seed,
                        **self._vocab(), **self._images()})

    def source_fingerprint(self, name: str) -> str:
        """Digest of what decides one source's sample order: a resume under a changed spec continues a
        source's cursor only where this is unchanged."""
        source = next(s for s in self.sources if s.name == name)
        return _digest({"source": self._order_fields(source), "seed": self.seed, **self._vocab(),
                        **(self._images() if source.multimodal else {})})[:12]

    def mixture_fingerprint(self) -> str:
        """Digest of what decides the sources' shares: the mixture section and the sources' weights/windows."""
        core = self.model_dump(mode="json", include={"mixture"}, exclude_defaults=True)
        core["sources"] = [s.model_dump(mode="json", include=set(_MIXING_FIELDS), exclude_defaults=True)
                           for s in self.sources]
        return _digest(core)[:8]

    def legacy_fingerprint(self) -> str:
        """The data fingerprint of plait before run-time mixing (sources with weights, mixture, seed):
        data states saved then still load."""
        core = self.model_dump(mode="json", include={"sources", "mixture", "seed"})
        for s in core["sources"]:
            for key in ("on_error", "storage_options", "shadows", "length_field", *_NEW_SOURCE_FIELDS, *_IMAGE_FIELDS):
                s.pop(key, None)
        for key in ("schedule_by", "online"):
            core["mixture"].pop(key, None)
        for p in core["mixture"]["schedule"]:
            p.pop("tokens", None)
        core.update(self._vocab())
        return _digest(core)

    def _order_fields(self, source: SourceSpec) -> dict:
        d = source.model_dump(mode="json")
        for key in ("on_error", "storage_options", "shadows", "length_field", *_MIXING_FIELDS):
            d.pop(key, None)  # how a source is read or weighted, not which samples in which order
        for key in _IMAGE_FIELDS:  # only when set: text-only sources keep their fingerprint
            if d.get(key) is None:
                d.pop(key, None)
        return d

    def _images(self) -> dict:
        # the image policy decides placeholder counts, hence documents' tokens (only when set; fast_jpeg: pixels only)
        out = {"images": self.images.model_dump(mode="json", exclude={"fast_jpeg"})} if self.images is not None else {}
        if self.videos is not None:  # fast_resize: pixels only
            out["videos"] = self.videos.model_dump(mode="json", exclude={"fast_resize"})
        if self.audio is not None:  # the encoder's cost: balance only
            out["audio"] = self.audio.model_dump(mode="json", exclude={"encoder"})
        return out

    def _vocab(self) -> dict:
        # vocab_size decides which records are delivered (only when set: old states keep their fingerprint)
        return {"vocab_size": self.vocab_size} if self.vocab_size is not None else {}

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


_MIXING_FIELDS = ("weight", "start_step", "stop_step")
_NEW_SOURCE_FIELDS = ("start_step", "stop_step")  # absent from the legacy fingerprint
_IMAGE_FIELDS = ("image_field", "image_root", "template", "video_field", "audio_field")  # in fingerprints only when set


def _digest(core: dict) -> str:
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]


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
            problems.append((field_path(err["loc"], data), msg))
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
            for key in ("path", "tokenizer", "image_root"):
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
