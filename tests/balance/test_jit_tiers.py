"""plait.jit's tiers: a process runs its kernels uncompiled until they have cost it COMPILE_AFTER_S of CPU
(or a balancing call of BIG_CALL items comes), then compiled; results never depend on the tier.

Each check runs in a process of its own: the tier is per process, and this one has compiled long ago."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

# The compiled tiers load the session's compile from numba's cache (tests/conftest.py) rather than compile
pytestmark = pytest.mark.usefixtures("numba_compiled")

# Random balancing steps (both modes, urgent items, encoder loads) and dynamic-CP steps, planned in the
# tier PLAIT_NUMBA asks for; every result pickled to stdout.
PLANS = r"""
import pickle, sys
import numpy as np
from plait import jit
from plait.balance.driver import assign
from plait.balance.cp_degrees import CommTable
from plait.balance.cp_plan import CPLayout, plan_dynamic_cp
from plait.cost import CommCost, CostModel
from plait.spec import CostSpec

rng = np.random.default_rng(int(sys.argv[1]))
out = []
for case in range(int(sys.argv[2])):
    if case == int(sys.argv[2]) // 2 and sys.argv[3] == "switch":
        jit.charge(jit.COMPILE_AFTER_S)  # as if the first half had cost that much: the rest runs compiled
    n, R, M = int(rng.integers(1, 400)), int(rng.integers(1, 9)), int(rng.integers(1, 5))
    C = int(rng.choice([64, 256, 1024]))
    lengths = rng.integers(1, C + 1, n).astype(np.int64)
    kw = {"mode": ("equal", "variable")[case % 2]}
    if case % 3 == 0:
        kw["priority"] = rng.integers(0, 3, n)
    if case % 4 == 0:
        kw.update(loads=rng.integers(0, C, (n, 2)), load_capacity=[2 * C, C])
    cap = max(C, int(lengths.sum() // (R * M)) + C)
    a = assign(lengths, lengths + lengths**2 / (C / 2.0), ranks=R, microbatches=M, capacity=cap, **kw)
    out.append(vars(a))
cc, model = CommCost.from_spec(CostSpec()), CostModel.from_spec(CostSpec())
for case in range(int(sys.argv[2]) // 4):
    layout = CPLayout(8, 256, int(rng.integers(1, 3)), 4, 1.0, bool(case % 2))
    lengths = rng.integers(1, 4 * 256, int(rng.integers(1, 50))).astype(np.int64)
    k = np.maximum(np.arange(5), 1)
    comm = CommTable(cc.slope(k, False), cc.slope(k, True), cc.intercept(k), 8)
    a = plan_dynamic_cp(lengths, model.text(lengths), layout, comm).assignment
    out.append({k: getattr(a, k) for k in ("item_group", "size", "first", "wave", "rank_cost", "micro_tokens")})
print(jit.TIER.compiled, "numba" in sys.modules, file=sys.stderr)
sys.stdout.buffer.write(pickle.dumps(out))
"""


def run(code: str, *args: str, numba: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_NUMBA"}
    if numba is not None:
        env["PLAIT_NUMBA"] = numba
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc


def test_every_tier_plans_the_same_steps():
    """Uncompiled (PLAIT_NUMBA=0), compiled from the first call (=1) and tiered (unset: it switches
    halfway, once COMPILE_AFTER_S is charged) give the same assignments, array for array."""
    plans = {}
    for numba in ("0", "1", None):
        proc = run(PLANS, "7", "160", "switch" if numba is None else "", numba=numba)
        plans[numba] = pickle.loads(proc.stdout)
        compiled, imported = proc.stderr.decode().split()[-2:]
        if numba == "0":
            assert (compiled, imported) == ("False", "False")  # numba never imported
        else:
            assert compiled == "True"
    assert len(plans["0"]) == 200
    for numba in ("1", None):
        for got, want in zip(plans[numba], plans["0"], strict=True):
            assert got.keys() == want.keys()
            for key in want:
                assert np.array_equal(np.asarray(got[key]), np.asarray(want[key])), key


TIERS = r"""
import json, sys, time
import numpy as np
from plait import jit, kernels
from plait.balance.driver import assign

seen = {}
lengths = np.arange(1, 41, dtype=np.int64)
assign(lengths, lengths * 1.5, ranks=2, microbatches=2, capacity=64)
tokens = np.arange(64, dtype=np.int32)
out = np.empty(16, np.int32)
kernels.copy_spans(tokens, np.array([3], np.int64), np.array([16], np.int64), out, np.array([0], np.int64))
seen["small"] = [jit.TIER.compiled, "numba" in sys.modules, jit.TIER.spent_s > 0, kernels.tier()]
jit.charge(jit.COMPILE_AFTER_S)  # as if its uncompiled kernels had cost that much
assign(lengths, lengths * 1.5, ranks=2, microbatches=2, capacity=64)
kernels.copy_spans(tokens, np.array([3], np.int64), np.array([16], np.int64), out, np.array([0], np.int64))
seen["after"] = [jit.TIER.compiled, "numba" in sys.modules, kernels.tier()]
assert np.array_equal(out, tokens[3:19])
print(json.dumps(seen))
"""

BIG = r"""
import json, sys
import numpy as np
from plait import jit
from plait.balance.driver import assign

lengths = np.full(jit.BIG_CALL, 8, dtype=np.int64)
assign(lengths, lengths * 1.0, ranks=64, microbatches=4, capacity=1024)
print(json.dumps([jit.TIER.compiled, jit.TIER.spent_s]))
"""


def test_a_process_compiles_once_its_uncompiled_kernels_cost_what_compiling_does():
    """A small job's process never imports numba; past COMPILE_AFTER_S of uncompiled kernels it compiles,
    balancing and packing kernels alike."""
    seen = json.loads(run(TIERS, numba=None).stdout.decode().strip().splitlines()[-1])
    assert seen["small"] == [False, False, True, "undecided"]  # uncompiled, numba not imported, CPU counted
    assert seen["after"] == [True, True, "numba"]


def test_a_large_balancing_call_compiles_first():
    compiled, spent = json.loads(run(BIG, numba=None).stdout.decode().strip().splitlines()[-1])
    assert compiled and spent == 0.0  # not one uncompiled kernel ran


def test_loader_actors_numpy_choice_holds_past_the_budget():
    """use_compiled(False) (the Ray runtime's SourceLoader, Constructor and shadow actors) keeps the numpy
    kernels whatever the tier says, and numba unimported."""
    code = ("import sys, numpy as np\nfrom plait import jit, kernels\nkernels.use_compiled(False)\n"
            "jit.charge(10.0)\nout = np.empty(4, np.int32)\n"
            "kernels.copy_spans(np.arange(8, dtype=np.int32), np.array([2]), np.array([4]), out, np.array([0]))\n"
            "print(kernels.tier(), 'numba' in sys.modules, out.tolist())")
    assert run(code, numba=None).stdout.decode().split() == ["numpy", "False", "[2,", "3,", "4,", "5]"]
