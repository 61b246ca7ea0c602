"""Cost models: FLOP-derived coefficients, tiles, the encoder term, CP sharding, fitting, `plait fit-cost`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from plait.cli import main
from plait.cost import CostModel, EncoderCost, nnls
from plait.spec import CostSpec


def test_from_dims_matches_the_flop_count():
    h, L_, f, n = 4096, 32, 11008, 32
    m = CostModel.from_dims(h, L_, f, n)
    per_layer_fwd = lambda L: L * (4 * h * h * 2 + 6 * h * f) + 2 * h * L * L  # noqa: E731  (g = n: MHA)
    for L in (1, 100, 8192, 131072):
        assert m(np.array([L]))[0] == pytest.approx(3 * L_ * per_layer_fwd(L))
    assert m.crossover == pytest.approx(2 * h * 2 + 3 * f)  # ~49k for a 7B model
    gqa = CostModel.from_dims(h, L_, f, n, kv_heads=8)
    assert gqa.linear < m.linear and gqa.quadratic == m.quadratic


def test_from_spec_explicit_and_dims():
    assert CostModel.from_spec(CostSpec(linear=2.0, quadratic=0.5, attention_tile=128)) == CostModel(2.0, 0.5, 128)
    assert CostModel.from_spec(CostSpec()) == CostModel.from_dims(4096, 32, 11008, 32)


def test_attention_tile_pads_the_quadratic_term_only():
    m = CostModel(1.0, 1.0, tile=128)
    assert m(np.array([1]))[0] == 1 + 128**2
    assert m(np.array([128]))[0] == 128 + 128**2
    assert m(np.array([129]))[0] == 129 + 256**2


def test_encoder_term_is_a_separate_component():
    enc = EncoderCost(10.0, 0.5)
    m = CostModel(1.0, 0.01, encoder=enc)
    L = np.array([100, 100, 50])
    P = np.array([0, 256, 1024])
    np.testing.assert_allclose(m(L, P), m.text(L) + enc(P))
    assert m(L, P)[0] == m.text(L)[0]  # text items carry 0 patches
    np.testing.assert_allclose(m(L), m.text(L))  # no patches given: text only
    vit = EncoderCost.from_dims(1024, 24, 4096)
    assert vit(np.array([0]))[0] == 0 and vit(np.array([2]))[0] > 2 * vit(np.array([1]))[0]


def test_per_doc_term():
    m = CostModel(1.0, 0.0, per_doc=5.0)
    np.testing.assert_allclose(m(np.array([0, 1, 10])), [0.0, 6.0, 15.0])


@given(st.integers(1, 8), st.integers(1, 64))
def test_head_tail_sharding_gives_each_cp_rank_cost_over_cp(cp, piece):
    # A document of 2*cp pieces; CP rank i takes pieces i and 2cp-1-i. Causal attention work of a query
    # at position q is q+1 keys; every rank gets the same attention work and the same tokens.
    L = 2 * cp * piece
    work = np.arange(1, L + 1, dtype=np.float64)
    pieces = work.reshape(2 * cp, piece).sum(axis=1)
    per_rank = np.array([pieces[i] + pieces[2 * cp - 1 - i] for i in range(cp)])
    np.testing.assert_allclose(per_rank, work.sum() / cp)
    m = CostModel(3.0, 2.0)
    np.testing.assert_allclose(m.per_cp_rank(np.array([L]), cp), m(np.array([L])) / cp)


def test_fit_recovers_coefficients():
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(40):
        n = int(rng.integers(1, 100))
        L = rng.integers(1, 4096, n).astype(np.float64)
        rows.append((L.sum(), (L**2).sum(), n))
    sL, sL2, cnt = map(np.array, zip(*rows))
    t = 2e-6 * sL + 3e-11 * sL2 + 1e-5 * cnt + 2e-3
    model, rep = CostModel.fit(sL, sL2, cnt, t)
    assert model.linear == pytest.approx(2e-6, rel=1e-6)
    assert model.quadratic == pytest.approx(3e-11, rel=1e-6)
    assert model.per_doc == pytest.approx(1e-5, rel=1e-5)
    assert rep["overhead"] == pytest.approx(2e-3, rel=1e-5)
    assert rep["r2"] == pytest.approx(1.0) and rep["rel_err_max"] < 1e-6


def test_fit_is_non_negative():
    X = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    y = np.array([1.0, -1.0, 0.0])
    c = nnls(X, y)
    assert (c >= 0).all()
    with pytest.raises(ValueError):
        CostModel.fit([1], [1], [1], [1])


def test_fit_cost_command(tmp_path, capsys):
    rng = np.random.default_rng(1)
    lines = ["sum_L,sum_L2,count,time"]
    for _ in range(30):
        n = int(rng.integers(1, 50))
        L = rng.integers(1, 8192, n).astype(np.float64)
        t = 1e-6 * L.sum() + 2e-11 * (L**2).sum() + 1e-3
        lines.append(f"{L.sum()},{(L ** 2).sum()},{n},{t}")
    csv = tmp_path / "m.csv"
    csv.write_text("\n".join(lines) + "\n")
    out = tmp_path / "fit.json"
    assert main(["fit-cost", str(csv), "--json", str(out)]) == 0
    fit = json.loads(out.read_text())
    assert fit["linear"] == pytest.approx(1e-6, rel=1e-4) and fit["quadratic"] == pytest.approx(2e-11, rel=1e-4)
    assert "quadratic:" in capsys.readouterr().out


def test_fit_cost_command_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("sum_L,time\n1,2\n")
    assert main(["fit-cost", str(bad)]) == 2
    assert "missing column" in capsys.readouterr().err
    bad.write_text("sum_L,sum_L2,count,time\n1,2,3,x\n4,5,6,7\n")
    assert main(["fit-cost", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["fit-cost", str(tmp_path / "nope.csv")]) == 2
