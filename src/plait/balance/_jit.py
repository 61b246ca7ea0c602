"""The compile wrapper every kernel of the balancer goes through.

With numba installed, `jit` compiles a function in nopython mode, caches the machine code on disk
(`cache=True`, so a new process loads it instead of compiling again) and releases the GIL while it runs
(`nogil=True`, so a Planner thread does not stall the loader threads). Without numba the very same Python
function runs uncompiled: slower, with the same results, so no output ever depends on numba being there.
"""

from __future__ import annotations

try:  # numba compiles the hot loops; without it the same functions run as plain Python (slow).
    from numba import njit as _numba_njit

    def jit(fn):
        return _numba_njit(cache=True, nogil=True)(fn)
except ImportError:  # pragma: no cover - numba is a core dependency

    def jit(fn):
        return fn
