"""Media placeholder ids inside documents without media.

A Qwen2-VL-style model takes every `image_token_id` (and `video_token_id`) in input_ids for an image
(video) position and fails when their number differs from the images it is given ("Image features and
image tokens do not match"). A pre-tokenized text source whose ids happen to hold one (151655 is an
ordinary id to a text tokenizer's data) then breaks the steps it lands in. Documents *with* media are
checked where they are built (multimodal.ImageDocs: their text may not hold the ids); this is the check of
the others, per source (`placeholder_ids`):

  unset    warn and count: the documents are delivered as they are; each source's count is in
           `error_report()` (`placeholder_documents`) and logged once per source;
  refuse   each such document is a bad record, named (source, shard, record): `on_error` decides
           (raise stops the run, skip leaves it out and counts it);
  replace  each such id becomes `placeholder_replacement` (an id the model embeds as text, e.g. the
           tokenizer's pad): the document stays, the forward works, and its labels predict that id.

Vectorised: one `isin` over a block's tokens; only a block holding such ids pays for finding them.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from plait.media.registry import KINDS
from plait.ragged import ragged_arange
from plait.sources.blocks import DocBlock

log = logging.getLogger("plait.data")


def placeholder_id_names(job) -> dict[int, str]:
    """{id: the spec field that names it} of the job's media placeholders (none without media sections)."""
    if job is None:
        return {}
    return {kind.token_id(job): f"{kind.section}.{kind.token_field}" for kind in KINDS
            if kind.token_id(job) is not None}


class PlaceholderCheck:
    """One source's check of its documents without media (module docstring). `documents`: the (file,
    row) of every document found holding a placeholder id (under the default policy), each once."""

    def __init__(self, source: str, policy: str | None, replacement: int | None, names: dict[int, str], bad):
        self.source, self.policy, self.replacement, self.names, self.bad = source, policy, replacement, names, bad
        self.ids = np.asarray(sorted(names), dtype=np.int64)
        self.documents: set[tuple[str, int]] = set()

    def apply(self, block: DocBlock, path: str) -> DocBlock:
        """The block with its media-free documents that hold placeholder ids warned about (counted),
        refused (bad records, left out) or rewritten, by the source's policy."""
        if not len(self.ids) or not len(block.tokens):
            return block
        hit = np.isin(block.tokens, self.ids)
        if not hit.any():
            return block
        seen = np.concatenate([[0], np.cumsum(hit)])
        per_doc = seen[block.starts + block.lengths] - seen[block.starts]
        if block.images is not None:
            per_doc = np.where(block.images.count > 0, 0, per_doc)  # documents with media: ImageDocs checks them
        docs = np.flatnonzero(per_doc > 0)
        if not len(docs):
            return block
        if self.policy == "replace":
            return self._replaced(block, docs)
        reason = self._reason(block, docs[0])
        if self.policy == "refuse":
            for d in docs:
                self.bad.record(path, str(int(block.rows[d])), self._reason(block, d))
            return _without(block, docs)
        new = {(path, int(block.rows[d])) for d in docs} - self.documents
        if new and not self.documents:
            log.warning("source %r: document %s of %s holds %s without media: a vision-language model's forward "
                        "takes it for a media position and fails; counted in Loader.error_report() "
                        "(placeholder_documents); set the source's placeholder_ids: refuse or replace",
                        self.source, int(block.rows[docs[0]]), path, reason)
        self.documents |= new
        return block

    def _reason(self, block: DocBlock, doc: int) -> str:
        toks = block.tokens[block.starts[doc]:block.starts[doc] + block.lengths[doc]]
        found = [int(i) for i in self.ids if np.any(toks == i)]
        named = ", ".join(f"{i} ({self.names[i]})" for i in found)
        return f"media placeholder id {named} in a document without media"

    def _replaced(self, block: DocBlock, docs: np.ndarray) -> DocBlock:
        tokens = np.array(block.tokens, copy=True)  # a token-id block's buffer is Arrow's, read-only
        spans = ragged_arange(block.starts[docs], block.lengths[docs])
        sel = spans[np.isin(tokens[spans], self.ids)]
        tokens[sel] = self.replacement
        return replace(block, tokens=tokens)


def _without(block: DocBlock, docs: np.ndarray) -> DocBlock:
    """The block less documents `docs` (their positions stay counted in num_positions, like any bad record)."""
    keep = np.setdiff1d(np.arange(len(block.rows)), docs)
    return replace(block, positions=block.positions[keep], rows=block.rows[keep], starts=block.starts[keep],
                   lengths=block.lengths[keep], images=block.images.take_docs(keep) if block.images is not None else None)
