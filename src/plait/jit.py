"""When a process compiles plait's numba kernels: tiered, as a JIT's tiers are.

plait's hot loops (the balancer's kernels in plait.balance, the packing kernels in plait.kernels) are
numba functions that also run uncompiled, with the same results: the balancer's as the very same Python
functions, the packing kernels as numpy versions. Running compiled has a price per process: importing
numba and llvmlite (~0.3 CPU-s, 60-80 MiB resident) and loading the machine code from numba's on-disk
cache (~0.45 CPU-s; tens of seconds where the cache is cold). A process that plans or packs little (a
test, a demo, the Planner of a job of a few hundred documents a step, a trainer of a short run) never
earns that back.

So a process starts uncompiled and compiles once its uncompiled kernels have cost it COMPILE_AFTER_S of
CPU (about what compiling costs: the rent-or-buy rule, never more than twice the better choice's cost),
or at once for a balancing call of BIG_CALL items or more (`hint`). Once compiled it stays compiled.
PLAIT_NUMBA in the environment: `1` compiles at the first call, `0` never compiles, unset (or `auto`)
is the tiered rule. Results never depend on the tier (tests/balance/test_jit_tiers.py checks it).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

COMPILE_AFTER_S = 1.0  # CPU seconds of uncompiled kernels after which a process compiles them
BIG_CALL = 20_000  # a balancing call over this many items compiles first (~0.5 s uncompiled)
_ENV = {"": "auto", "auto": "auto", "1": "always", "0": "never"}


class Tier:
    """This process's tier: its mode, whether it compiled, and the CPU its uncompiled kernels cost."""

    def __init__(self) -> None:
        self.mode = _ENV.get(os.environ.get("PLAIT_NUMBA", ""), "auto")
        self.compiled = False
        self.spent_s = 0.0
        self.lock = threading.Lock()
        self.rebind_due = False  # a kernel module was imported after the switch (Kernel)
        self.local = threading.local()  # depth of kernel calls in this thread: only the outermost is timed


TIER = Tier()


def compiled() -> bool:
    """Whether this process runs the compiled kernels, deciding now by its tier's rule (and compiling)."""
    if TIER.compiled:
        return True
    if TIER.mode == "never":
        return False
    if TIER.mode == "always" or TIER.spent_s >= COMPILE_AFTER_S:
        return compile_now()
    return False


def hint(items: int) -> None:
    """A balancing call over `items` items is coming: a large one compiles first."""
    if items >= BIG_CALL and not TIER.compiled and TIER.mode != "never":
        compile_now()


def compile_now() -> bool:
    """Compile (or load from numba's cache) on first use from now on; False where numba is missing."""
    with TIER.lock:
        if TIER.compiled:
            return True
        try:
            import numba  # noqa: F401
        except ImportError:  # pragma: no cover - numba is a core dependency
            TIER.mode = "never"
            return False
        _compile_kernels()
        TIER.compiled = True
        return True


def charge(seconds: float) -> None:
    """Uncompiled kernels cost this process `seconds` of CPU more."""
    TIER.spent_s += seconds


class Kernel:
    """A numba kernel that runs as plain Python until the process compiles, then calls numba's dispatcher.

    Kernels call each other through their modules' globals. At the switch every module global that
    names a Kernel is rebound to the kernel's dispatcher, so numba compiles a caller against its callees'
    dispatchers; Python code that imported a Kernel keeps calling it here. A kernel module imported after
    the switch is rebound at the next call of any Kernel (TIER.rebind_due)."""

    def __init__(self, fn: Callable):
        self.fn = self.target = self.__wrapped__ = fn
        self.__doc__, self.__name__, self.__qualname__ = fn.__doc__, fn.__name__, fn.__qualname__
        self.__module__ = fn.__module__
        KERNELS.append(self)
        if TIER.compiled:
            self.target = _njit()(fn)
            TIER.rebind_due = True

    def __call__(self, *args):
        if TIER.compiled or compiled():
            if TIER.rebind_due:
                _rebind()
            return self.target(*args)
        local = TIER.local
        if getattr(local, "depth", 0):  # inside another uncompiled kernel: timed there
            return self.fn(*args)
        local.depth = 1
        start = time.thread_time()
        try:
            return self.fn(*args)
        finally:
            local.depth = 0
            charge(time.thread_time() - start)


KERNELS: list[Kernel] = []


def jit(fn: Callable) -> Kernel:
    """The decorator of plait's balancing kernels: compiled in nopython mode once the process compiles,
    machine code cached on disk (a new process loads it), the GIL released while it runs (a Planner
    thread does not stall loader threads)."""
    return Kernel(fn)


def _njit():
    from numba import njit

    return njit(cache=True, nogil=True)


def _compile_kernels() -> None:
    compile_one = _njit()
    for kernel in KERNELS:
        kernel.target = compile_one(kernel.fn)
    _rebind()


def _rebind() -> None:
    """Every kernel module's globals that name a Kernel name its dispatcher instead."""
    TIER.rebind_due = False
    for space in {id(k.fn.__globals__): k.fn.__globals__ for k in KERNELS}.values():
        for name, value in list(space.items()):
            if isinstance(value, Kernel):
                space[name] = value.target
