"""Compiled inner loops (numba) for the per-token work of packing, with numpy versions.

Each kernel makes one pass over the tokens it writes. numba compiles them on first use and caches the
machine code next to this file, so later processes start fast.

numba (with llvmlite) costs a process about 60-80 MiB resident, so it is imported on a kernel's first
call, not with this module, and a process may choose the numpy versions instead (`use_compiled(False)`,
or PLAIT_NUMBA=0 in its environment) before that call. Both versions write exactly the same values.
The Ray runtime's SourceLoader and Constructor actors use the numpy versions: there the per-token work
is a few slice copies per request, small next to the transfer, and every actor process saved is memory
saved per node. The Planner's balancing kernels (balance.py) stay compiled.
"""

from __future__ import annotations

import os

import numpy as np

from plait.ragged import ragged_arange

_compiled: bool | None = None if os.environ.get("PLAIT_NUMBA", "1") != "0" else False
_impl: tuple | None = None  # (copy_spans, fill_positions_labels) once resolved


def use_compiled(flag: bool) -> None:
    """Choose numba (True) or numpy (False) kernels for this process; takes effect if no kernel ran yet."""
    global _compiled
    if _impl is None:
        _compiled = bool(flag)


def _copy_spans_np(src, src_starts, lengths, out, out_starts):
    # One gather and one scatter for all spans (no Python loop per document).
    out[ragged_arange(out_starts, lengths)] = src[ragged_arange(src_starts, lengths)]


def _fill_positions_labels_np(input_ids, cu, position_ids, labels, ignore):
    lengths = np.diff(cu)
    position_ids[:] = np.arange(len(input_ids), dtype=position_ids.dtype) - np.repeat(cu[:-1], lengths)
    labels[:-1] = input_ids[1:]
    if len(input_ids):
        labels[cu[1:][lengths > 0] - 1] = ignore


def _numba_kernels() -> tuple | None:
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a core dependency; kept for odd platforms
        return None
    njit = numba.njit(cache=True, nogil=True)

    @njit
    def copy_spans(src, src_starts, lengths, out, out_starts):
        for i in range(len(lengths)):
            s = src_starts[i]
            d = out_starts[i]
            n = lengths[i]
            out[d : d + n] = src[s : s + n]

    @njit
    def fill_positions_labels(input_ids, cu, position_ids, labels, ignore):
        for d in range(len(cu) - 1):
            a = cu[d]
            b = cu[d + 1]
            if b <= a:
                continue
            for t in range(a, b - 1):  # one pass: read each id once, write both outputs
                position_ids[t] = t - a
                labels[t] = input_ids[t + 1]
            position_ids[b - 1] = b - 1 - a
            labels[b - 1] = ignore

    return copy_spans, fill_positions_labels


def numpy_kernels() -> tuple:
    """(copy_spans, fill_positions_labels) written with numpy: the reference the compiled ones match."""
    return _copy_spans_np, _fill_positions_labels_np


def compiled_kernels() -> tuple | None:
    """(copy_spans, fill_positions_labels) compiled by numba, or None where numba is missing."""
    return _numba_kernels()


def _kernels() -> tuple:
    global _impl, _compiled
    if _impl is None:
        impl = _numba_kernels() if _compiled is not False else None
        _compiled = impl is not None
        _impl = impl or (_copy_spans_np, _fill_positions_labels_np)
    return _impl


def copy_spans(src, src_starts, lengths, out, out_starts):
    """out[out_starts[i]:+lengths[i]] = src[src_starts[i]:+lengths[i]] for every i."""
    (_impl or _kernels())[0](src, src_starts, lengths, out, out_starts)


def fill_positions_labels(input_ids, cu, position_ids, labels, ignore):
    """position_ids restart at every document of `cu`; labels are input_ids shifted left by one, with
    `ignore` at each document's last token."""
    (_impl or _kernels())[1](input_ids, cu, position_ids, labels, ignore)


def warm_up() -> None:
    """Compile (or load from cache) the kernels now, so the first batch is not slowed by it."""
    tokens = np.arange(8, dtype=np.int32)
    out = np.empty(4, dtype=np.int32)
    copy_spans(tokens, np.array([2], np.int64), np.array([4], np.int64), out, np.array([0], np.int64))
    # and from a compact block's uint16 ids (sources/blocks.compact)
    copy_spans(tokens.astype(np.uint16), np.array([2], np.int64), np.array([4], np.int64), out, np.array([0], np.int64))
    cu = np.array([0, 4], dtype=np.int32)
    fill_positions_labels(out, cu, np.empty(4, np.int32), np.empty(4, np.int32), -100)
