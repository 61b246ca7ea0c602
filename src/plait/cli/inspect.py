"""`plait inspect`: a spec's sources, files and first documents, without streaming."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.table import Table

from plait.cli.common import table_console
from plait.roles.source_loader import SourceLoader
from plait.media.audio import AudioRef
from plait.spec import load_spec
from plait.media.video import VideoRef

SHOWN_FRAMES = 6  # sampled frame indices shown before "..." and the last one

HELP = "show a spec's sources, files and a few documents"
DESCRIPTION = (
    "Validate SPEC and show each source's files, format, first block and "
    "document-length statistics, without streaming; for video sources, the previewed documents' videos "
    "(sampled frames, size, grid, tokens); for audio sources, their clips (duration, windows, tokens)."
)


def add_arguments(p) -> None:
    p.add_argument("spec", help="the spec (YAML)")
    p.add_argument("--docs", type=int, default=3, help="documents to preview per source")


def run(args) -> int:
    spec = load_spec(args.spec)
    loader = SourceLoader(spec)
    out = table_console()
    vocab = f"; model vocab_size {spec.vocab_size}" if spec.vocab_size else "; no vocab_size stated"
    table = Table(title=f"sources of {args.spec}{vocab}")
    for col in ("source", "format", "files", "weight", "first block docs", "median len", "max len", "tokenizer",
                "tokenizer vocab", "max id (first block)"):
        table.add_column(col)
    previews, videos, clips, placeholders = [], [], [], []
    for i, s in enumerate(spec.sources):
        src = loader.sources[i]
        key = loader.first_key(i)
        meta = loader.block_meta(i, key)
        fmt = type(src.reader).__name__.replace("Reader", "").lower()
        lens = meta.lengths
        block = loader.block(i, key)
        tok_vocab = str(src.encoder.vocab_size) if src.encoder is not None else "-"
        max_id = str(int(block.tokens.max())) if len(block.tokens) else "-"
        table.add_row(s.name, fmt, str(len(src.files)), f"{s.weight:g}", str(len(lens)),
                      f"{np.median(lens):.0f}" if len(lens) else "-", str(int(lens.max())) if len(lens) else "-",
                      Path(s.tokenizer).name if s.tokenizer else ("bytes" if s.text_field else "pre-tokenized"),
                      tok_vocab, max_id)
        for d in range(min(args.docs, len(lens))):
            toks = block.tokens[block.starts[d] : block.starts[d] + block.lengths[d]]
            failed = block.failed is not None and bool(block.failed[d])  # planned, then failed at decode (counted)
            previews.append((s.name, Path(src.files[block.shard]).name, int(block.rows[d]),
                             "failed at decode" if failed else len(toks), toks[:12].tolist()))
        videos += video_rows(s.name, block, min(args.docs, len(lens)))
        clips += audio_rows(s.name, block, min(args.docs, len(lens)))
        placeholders += placeholder_lines(s.name, src)
    out.print(table)
    for line in placeholders:
        out.print(line, highlight=False)
    prev = Table(title="first documents in order")
    for col in ("source", "shard", "row", "tokens", "first ids"):
        prev.add_column(col)
    for name, shard, row, n, ids in previews:
        prev.add_row(name, shard, str(row), str(n), " ".join(map(str, ids)))
    out.print(prev)
    if videos:
        table = Table(title="videos of the first documents (the rule's plan, from the headers)")
        for col in ("source", "row", "video", "frames sampled", "size", "grid (t, h, w)", "tokens"):
            table.add_column(col)
        for row in videos:
            table.add_row(*row)
        out.print(table)
    if clips:
        table = Table(title="audio clips of the first documents (the window policy's plan, from the headers)")
        for col in ("source", "row", "clip", "seconds", "rate / channels / codec", "windows", "tokens"):
            table.add_column(col, justify="right" if col in ("seconds", "windows", "tokens") else "left")
        for row in clips:
            table.add_row(*row)
        out.print(table)
    return 0


def placeholder_lines(name: str, src) -> list[str]:
    """A warning per source whose first block has documents without media holding a media placeholder id
    (plait.sources.placeholder_ids: found while the block was read)."""
    found = sorted(src.placeholders.documents)
    if not found:
        return []
    ids = ", ".join(f"{i} ({field})" for i, field in src.placeholders.names.items())
    rows = ", ".join(str(row) for _, row in found[:5]) + (", ..." if len(found) > 5 else "")
    return [f"[bold yellow]warning:[/] source {name!r}: {len(found)} document(s) of its first block without media "
            f"hold a media placeholder id ({ids}; rows {rows}): a vision-language model's forward takes it for a "
            "media position and fails; set the source's placeholder_ids: refuse or replace"]


def video_rows(source: str, block, docs: int) -> list[tuple[str, ...]]:
    """Per video of the block's first `docs` documents: where it is and what the rule makes of it."""
    t = block.images
    rows = []
    for d in range(docs if t is not None else 0):
        for j in range(int(t.start[d]), int(t.start[d] + t.count[d])):
            ref = t.refs[j]
            if not isinstance(ref, VideoRef) or ref.plan is None:
                continue
            p = ref.plan
            where = ref.ref if isinstance(ref.ref, str) else f"<{len(ref.ref)} inline bytes>"
            rows.append((source, str(int(block.rows[d])), where + (f" (clip window {ref.window})" if ref.window else ""),
                         frames_text(p.indices), f"{p.width}x{p.height}", " x ".join(map(str, p.grid)), f"{p.tokens:,}"))
    return rows


def audio_rows(source: str, block, docs: int) -> list[tuple[str, ...]]:
    """Per clip of the block's first `docs` documents: where it is, what its headers say, its windows and
    placeholder tokens under the spec's window policy."""
    t = block.images
    rows = []
    for d in range(docs if t is not None else 0):
        for j in range(int(t.start[d]), int(t.start[d] + t.count[d])):
            ref = t.refs[j]
            if not isinstance(ref, AudioRef) or ref.plan is None:
                continue
            info, plan = ref.info, ref.plan
            where = ref.ref if isinstance(ref.ref, str) else f"<{len(ref.ref)} inline bytes>"
            rows.append((source, str(int(block.rows[d])), where, f"{plan.seconds:.2f}",
                         f"{info.sample_rate:,} Hz / {info.channels} / {info.codec}", str(plan.windows), f"{plan.tokens:,}"))
    return rows


def frames_text(indices: tuple[int, ...]) -> str:
    """'n: i0 i1 ... i_last' with the first SHOWN_FRAMES indices."""
    shown = " ".join(map(str, indices[:SHOWN_FRAMES]))
    more = f" ... {indices[-1]}" if len(indices) > SHOWN_FRAMES else ""
    return f"{len(indices)}: {shown}{more}"
