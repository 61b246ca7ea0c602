"""A thin client reads the served job's stream, so its spec must be the served one (issue 39, item 15): a
spec that differs only in its mixture (a weight) is refused with a sentence saying what to do, where it
was accepted silently and got the server's mixture. The node-shared data plane's ranks are thin clients
of their host and are refused the same way."""

from __future__ import annotations

import pytest

pytest.importorskip("pyarrow.flight")

import plait  # noqa: E402
from helpers import make_spec, token_parquet  # noqa: E402
from plait.runtime.serve_local import LocalJobServer  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("thin-spec")
    return [token_parquet(root / n, name=n, files=1, docs_per_file=20, lo=4, hi=30, seed=i) for i, n in enumerate("ab")]


def test_a_client_whose_weights_differ_from_the_served_spec_is_refused(sources):
    a, b = sources
    served = make_spec([a, b], seq_len=64, microbatches=1, dp=1)
    reweighted = make_spec([a, b.with_options(weight=3.0)], seq_len=64, microbatches=1, dp=1)
    with LocalJobServer(plait.load_spec(served), "weights") as server:
        with pytest.raises(plait.PlaitError, match="runs another mixture than this client's spec .*allow_spec_change"):
            plait.Loader(reweighted, runtime="flight", job_address=server.address, token=server.token)
        with plait.Loader(served, runtime="flight", job_address=server.address, token=server.token) as loader:
            assert next(iter(loader)).step == 0  # the served spec itself is accepted
