"""The resume matrix shared by tests/state/test_resume_changes.py and tests/runtime/ray/test_resume_changes_ray.py: a
step-boundary checkpoint of any runtime resumes under every allowed spec change (weights, a source
added, a source removed), on the same DP size or another one."""

from __future__ import annotations

import json
import warnings

import plait
from helpers import make_spec, token_parquet

HEAD_STEPS = 2  # steps consumed before the checkpoint
TAIL_STEPS = 2  # steps consumed after the resume
CHANGES = ("weights", "added", "removed")
DPS = (2, 1)  # the saving spec's DP size, and another one


def make_data(root) -> list:
    return [token_parquet(root / n, files=2, docs_per_file=40, row_group_size=5, lo=4, hi=40, seed=i,
                          name=n) for i, n in enumerate("abc")]


def spec_before(data) -> dict:
    a, b, _ = data
    return make_spec([a, b], seq_len=64, microbatches=2, dp=2)


def spec_after(data, change: str, dp: int) -> dict:
    a, b, c = data
    sources = {"weights": [a, b.with_options(weight=3.0)], "added": [a, b, c], "removed": [a]}[change]
    return make_spec(sources, seq_len=64, microbatches=2, dp=dp)


def boundary_state(loader) -> dict:
    """Consume HEAD_STEPS whole steps of rank 0 and return its state as a file would hold it."""
    it = iter(loader)
    for _ in range(HEAD_STEPS * 2):
        next(it)
    it.close()
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["at_step_boundary"] and state.get("next") is not None, "the runtime wrote no state after the step"
    return state


def resume(loader, state) -> list:
    """Load `state` with allow_spec_change and consume TAIL_STEPS steps of the loader's rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SpecChangeWarning / LayoutChangeWarning: checked by resume_report
        loader.load_state_dict(state, allow_spec_change=True)
    assert loader.resume_report, "the spec change was not reported"
    out = []
    for mb in loader:
        out.append(mb)
        if len(out) == TAIL_STEPS * 2:
            break
    return out


def local_tail(spec, state) -> list:
    with plait.Loader(spec, 0, read_ahead=0, share="process") as loader:
        return resume(loader, state)


def sample_ids(batches) -> list:
    return [mb.sample_ids.tolist() for mb in batches]


def check_tail(tail: list, reference: list, change: str) -> None:
    """The resumed stream starts at the step after the checkpoint and is the local runtime's, bit for bit."""
    assert tail[0].step == HEAD_STEPS and tail[0].microbatch == 0
    assert sample_ids(tail) == sample_ids(reference)
    sources = {s for mb in tail for s in mb.source_ids.tolist()}
    if change == "added":
        assert 2 in sources  # the new source is drawn
    if change == "removed":
        assert sources == {0}


__all__ = ["CHANGES", "DPS", "boundary_state", "check_tail", "local_tail", "make_data",
           "resume", "spec_after", "spec_before"]


def changed_weights_case(tmp_path, read) -> tuple[dict, dict, dict]:
    """A boundary state saved under the original spec, the spec with a changed weight, and each of two
    ranks' reference sample ids: `read(loader, state)` on a per-process Loader of the changed spec."""
    data = make_data(tmp_path)
    with plait.Loader(spec_before(data), 0, read_ahead=0, share="process") as loader:
        saved = boundary_state(loader)
    spec = spec_after(data, "weights", 2)
    reference = {}
    for r in range(2):
        with plait.Loader(spec, r, read_ahead=0, share="process") as loader:
            reference[r] = sample_ids(read(loader, saved))
    return spec, saved, reference
