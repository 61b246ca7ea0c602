"""What a thin client asks of a served job over its control channel, one method each: the same for a
trainer reading over Arrow Flight (plait.runtime.flight) and one reading its node's shared memory
(plait.runtime.node_shm_client). No pyarrow here: the shared-memory reader must not load it.

A class using `ServedJobCalls` holds `control` (its channel: `action(name, body=None)`), `_gen` (the plan
generation it reads), `_next_step` and `_base` ((gen, step, state) of where it joined).
"""

from __future__ import annotations

from plait.job.stream import state_after


class ServedJobCalls:
    def _start_from_base(self) -> None:
        """Where this reader starts: the job's current generation and the state it holds (known without
        asking again). After `hello` and the client's own checks of `info`."""
        self._gen, base = self.control.action("base")
        self.job = self.info["job"]
        self._next_step = int(base["step"])
        self._base = (self._gen, self._next_step, base)

    def _seek(self, state: dict) -> None:
        self._gen = self.control.action("seek", {"state": state})
        self._next_step = int(state["step"])

    def state_dict(self) -> dict:
        return self.state_at(self._gen, self._next_step)

    def state_at(self, gen: int, step: int) -> dict:
        """The data state at the start of `step` of plan generation `gen`: one control call (the job keeps
        the states of its plan window)."""
        if self._base[:2] == (gen, step):
            return self._base[2]
        return self.control.action("state_at", {"gen": gen, "step": step})

    def state_after(self, step: int) -> dict | None:
        """The data state after `step`: the start of the next one (the job's plan window holds it)."""
        return state_after(self.state_at, self._gen, step)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        if not allow_spec_change:
            self._seek(state)
            return []
        self._gen, changes = self.control.action("seek_with_changes", {"state": state})
        self._next_step = int(state["step"])
        return list(changes)

    def replan_after(self, state: dict, layout: dict) -> dict:
        """Elastic resume (plait.job.elastic): the job re-plans the step on its saved layout."""
        return self.control.action("replan_after", {"state": state, "layout": layout})

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """The job's one Planner applies it (call it from one rank); a planned step is refused."""
        self.control.action("set_weights", {"weights": dict(weights), "at_step": int(at_step)})

    def report(self, step: int, losses: dict[str, float]) -> None:
        self.control.action("report", {"step": int(step), "losses": dict(losses)})

    def error_report(self) -> dict:
        return self.control.action("error_report")

    def scaling_report(self) -> dict:
        """A thin client sees no loaders (the job's driver reports their rescaling)."""
        return {"events": [], "timeline": [], "options": None}
