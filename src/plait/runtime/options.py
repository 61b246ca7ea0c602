"""Options that were renamed so that one name means one thing at every layer (`read_ahead`: micro-batches
a trainer's reader thread holds; `build_ahead`: steps a job builds ahead; `job_address`: a served job's
rendezvous; `call_timeout` / `join_timeout`: how long a control call or a node's join may take). The old
names stay accepted, with a DeprecationWarning."""

from __future__ import annotations

import warnings

from plait.errors import PlaitError


def renamed(old: str, old_value, new: str, new_value):
    """The value of option `new` given under its deprecated name `old` (warned) or its own (None: neither)."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise PlaitError(f"{old}= and {new}= were both given ({old} is the deprecated name of {new})")
    warnings.warn(f"the option {old}= is deprecated: it is now called {new}=", DeprecationWarning, stacklevel=3)
    return old_value


# The name each runtime's constructor takes for the steps its job builds ahead of a rank's request; a Loader
# takes `build_ahead=` for all of them (RayOptions' name is `prefetch`: on a Loader that name is read_ahead's).
BUILD_AHEAD_NAMES = {"local": "build_ahead", "node": "build_ahead", "ray": "build_ahead"}


def build_ahead_option(runtime: str, options: dict) -> dict:
    """`options` with a Loader's `build_ahead=` checked and under the name `runtime` takes (unchanged without
    it). A thin client (flight) builds nothing: the served job's own option sets it."""
    value = options.get("build_ahead")
    if value is None:
        return {k: v for k, v in options.items() if k != "build_ahead"}
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlaitError(f"build_ahead= takes a whole number of steps, 0 or more (got {value!r})")
    if runtime not in BUILD_AHEAD_NAMES:
        raise PlaitError(f"build_ahead= is the job's option, and the {runtime} runtime's job is served elsewhere: "
                         "set it where it is served (`plait serve --build-ahead N`)")
    rest = {k: v for k, v in options.items() if k != "build_ahead"}
    return {**rest, BUILD_AHEAD_NAMES[runtime]: value}
