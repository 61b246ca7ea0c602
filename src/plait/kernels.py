"""Compiled inner loops (numba) for the per-token work of packing, with numpy versions.

Each compiled kernel makes one pass over the tokens it writes (4-6x faster than numpy's gather and
scatter: ~0.2 against ~0.9 ms for a 128k-token micro-batch). Both versions write exactly the same values.

Which one a process runs follows plait.jit's tiers: numpy until the process's uncompiled kernels have
cost it about what compiling costs (numba and llvmlite are then imported, 60-80 MiB resident, and the
machine code loaded from numba's on-disk cache next to this file), compiled from then on. A process may
fix its choice before its first kernel call: `use_compiled(False)` (numpy: the Ray runtime's SourceLoader,
Constructor and shadow actors, which copy a few spans per request, small next to the transfer, and save
numba's memory in every actor process) or `use_compiled(True)`; PLAIT_NUMBA=0 / 1 in the environment does
the same for every kernel of the process (plait.jit).
"""

from __future__ import annotations

import time

import numpy as np

from plait import jit
from plait.ragged import ragged_arange

_compiled: bool | None = None  # None: plait.jit's tiers decide
_impl: tuple | None = None  # (copy_spans, fill_positions_labels) once chosen for good


def use_compiled(flag: bool) -> None:
    """Choose numba (True) or numpy (False) kernels for this process; takes effect if no kernel ran yet."""
    global _compiled
    if _impl is None:
        _compiled = bool(flag)


def tier() -> str:
    """What this process's packing kernels are: `numba`, `numpy`, or `undecided` (numpy, timed, until
    plait.jit's tiers compile)."""
    return "undecided" if _impl is None else "numba" if _compiled else "numpy"


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


def _kernels() -> tuple | None:
    """The kernels this process runs from now on, or None while the tiers still say numpy (timed)."""
    global _impl, _compiled
    if _impl is None:
        if _compiled is None:
            if jit.TIER.mode != "never" and not jit.compiled():
                return None
            _compiled = jit.TIER.mode != "never"
        impl = _numba_kernels() if _compiled else None
        _compiled = impl is not None
        _impl = impl or (_copy_spans_np, _fill_positions_labels_np)
    return _impl


def _run(which: int, numpy_version, *args) -> None:
    """Kernel `which` of the chosen ones, or its numpy version (its CPU charged to plait.jit's tiers)."""
    impl = _impl or _kernels()
    if impl is not None:
        impl[which](*args)
        return
    start = time.thread_time()
    numpy_version(*args)
    jit.charge(time.thread_time() - start)


def copy_spans(src, src_starts, lengths, out, out_starts):
    """out[out_starts[i]:+lengths[i]] = src[src_starts[i]:+lengths[i]] for every i."""
    _run(0, _copy_spans_np, src, src_starts, lengths, out, out_starts)


def fill_positions_labels(input_ids, cu, position_ids, labels, ignore):
    """position_ids restart at every document of `cu`; labels are input_ids shifted left by one, with
    `ignore` at each document's last token."""
    _run(1, _fill_positions_labels_np, input_ids, cu, position_ids, labels, ignore)


def warm_up() -> None:
    """Compile (or load from cache) the kernels now, so the first batch is not slowed by it (unless this
    process chose numpy: use_compiled(False))."""
    if _compiled is not False:
        use_compiled(True)
    tokens = np.arange(8, dtype=np.int32)
    out = np.empty(4, dtype=np.int32)
    copy_spans(tokens, np.array([2], np.int64), np.array([4], np.int64), out, np.array([0], np.int64))
    # and from a compact block's uint16 ids (sources/blocks.compact)
    copy_spans(tokens.astype(np.uint16), np.array([2], np.int64), np.array([4], np.int64), out, np.array([0], np.int64))
    cu = np.array([0, 4], dtype=np.int32)
    fill_positions_labels(out, cu, np.empty(4, np.int32), np.empty(4, np.int32), -100)
