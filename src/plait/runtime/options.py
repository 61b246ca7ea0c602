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
