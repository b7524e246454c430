"""toolkit/figures.py: each figure carries exactly the numbers its rows function computed, SQNR is the textbook
ratio (an exact copy capped, a known noise its known dB), and the makespan rows count each chunk length's subgraphs."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from edgeprobe.figures import SQNR_CAP_DB, layer_sqnr, makespan_figure, makespan_rows, sqnr_db, sqnr_figure
from edgeprobe.models import ModelConfig
from edgeprobe.quant.schemes import INPUT_POINT
from edgeprobe.schedule import CostModel

OPS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def test_sqnr_of_an_exact_copy_is_capped_and_of_a_known_noise_is_its_db():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 48)).astype(np.float32)
    assert sqnr_db(ref, ref.copy()) == SQNR_CAP_DB and sqnr_db(ref, ref, cap=np.inf) == np.inf
    noise = rng.standard_normal(ref.shape)
    for db in (0.0, 20.0, 48.5):  # noise scaled so that Σref² / Σnoise² = 10^(db/10) exactly
        scaled = noise * np.sqrt(np.sum(ref.astype(np.float64) ** 2) / np.sum(noise ** 2) / 10 ** (db / 10))
        assert sqnr_db(ref, ref + scaled) == pytest.approx(db, abs=1e-9)
    assert sqnr_db(np.zeros(4), np.ones(4)) == -SQNR_CAP_DB  # no signal at all, some noise


def _tiny(n_layers=3, hidden=8, ffn=16):
    rng = np.random.default_rng(1)
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden, hidden), "attn_v": (hidden, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    weights = {f"blk.{i}.{op}.weight": rng.standard_normal(shapes[op]).astype(np.float32)
               for i in range(n_layers) for op in OPS}
    acts = {f"blk.{i}.{point}": rng.standard_normal((5, shapes[op][1])).astype(np.float32)
            for i in range(n_layers) for op, point in INPUT_POINT.items()}
    return SimpleNamespace(config=SimpleNamespace(n_layers=n_layers), weights=weights), acts


class _Scaled:
    """A 'quantized' model whose linear is float's times (1 + eps[layer]): its noise is eps² of the signal, so the
    SQNR is -20·log10(eps) dB per layer."""

    def __init__(self, model, eps):
        self.model, self.eps = model, eps

    def linear(self, name, x):
        i = int(name.split(".")[1])
        return (x @ self.model.weights[name + ".weight"].T) * (1 + self.eps[i])


def test_layer_sqnr_is_each_layers_signal_over_its_noise_and_the_figure_shows_it():
    model, acts = _tiny()
    assert set(INPUT_POINT) == set(OPS)  # every linear of a layer is compared
    eps = [1e-1, 1e-2, 1e-3]
    exact = SimpleNamespace(linear=lambda name, x: x @ model.weights[name + ".weight"].T)
    sq = layer_sqnr(model, {"scaled": _Scaled(model, eps), "exact": exact}, acts)
    np.testing.assert_allclose(sq["scaled"], [20.0, 40.0, 60.0], atol=1e-3)
    assert (sq["exact"] == SQNR_CAP_DB).all()
    fig = sqnr_figure(sq)
    assert [t.name for t in fig.data] == ["scaled", "exact"]
    for t in fig.data:
        assert list(t.x) == [0, 1, 2] and list(t.y) == sq[t.name].tolist()


def _manifest(n_layers=2, shadow=(0,)):
    cfg = ModelConfig(arch="llama", n_layers=n_layers, hidden=64, ffn=128, n_heads=4, n_kv_heads=2, head_dim=16,
                      vocab_size=100, context_length=1024)
    lin = {f"blk.{l}.{p}": ({"kind": "w8a8-shadow", "shadow": {"rows": "x"}} if l in shadow and p.startswith("attn_")
                            and p != "attn_output" else {"kind": "w8a8"})
           for l in range(n_layers) for p in OPS}
    tensors = {n: f"{i:064x}" for i, n in enumerate(["token_embd.weight", "output_norm.weight"] + [
        f"blk.{l}.{t}.weight" for l in range(n_layers) for t in ("attn_norm", "ffn_norm")])}
    return {"config": dataclasses.asdict(cfg), "tensors": tensors, "linears": lin}


def test_makespan_rows_count_the_chunks_order_the_schedulers_and_the_figure_shows_them():
    manifest = _manifest()
    cost = CostModel("test", {"npu": {"default": 50.0}, "cpu": {"default": 10.0}}, {"npu": 40.0, "cpu": 10.0},
                     sync_us=20.0)
    rows = makespan_rows(manifest, 200, (16, 64, 256), ("in-order", "ooo"), cost)
    assert [(r["chunk"], r["scheduler"]) for r in rows] == [(c, s) for c in (16, 64, 200) for s in ("in-order", "ooo")]
    # a chunk longer than the prompt is one chunk of all of it, as run: 13, 4 and 1 chunks of 2 layers' qkv, attn
    # and ffn subgraphs plus layer 0's shadow GEMM
    assert [r["subgraphs"] for r in rows] == [13 * 7] * 2 + [4 * 7] * 2 + [7] * 2
    assert all(r["makespan_ms"] > 0 and 0 < r["npu_busy_pct"] <= 100 for r in rows)
    by = {(r["chunk"], r["scheduler"]): r for r in rows}
    for c in (16, 64, 200):  # reordering never loses to in-order, and wins once there are chunks to overlap
        assert by[(c, "ooo")]["makespan_ms"] <= by[(c, "in-order")]["makespan_ms"]
    assert all(by[(c, "ooo")]["makespan_ms"] < by[(c, "in-order")]["makespan_ms"] for c in (16, 64))
    fig = makespan_figure(rows, cost_name=cost.name)
    assert [t.name for t in fig.data] == ["in-order", "ooo"] and "(test)" in fig.layout.title.text
    for t in fig.data:
        assert list(t.x) == [16, 64, 200] and list(t.y) == [by[(c, t.name)]["makespan_ms"] for c in (16, 64, 200)]


def test_schedule_names_a_fitted_cost_model_fitted_not_measured():
    from edgeprobe.cli.schedule import cost_kind
    from edgeprobe.schedule.cost import SNAPDRAGON_8GEN3, _build_fitted

    fitted = _build_fitted("phone-trace", {"npu": {"int8_linear": {"fixed_us": 5.0, "us_per_flop": 1e-6}}}, None,
                           "fitted from a trace", 0.0, {}, {}, {})
    measured = dataclasses.replace(SNAPDRAGON_8GEN3, name="agent", modelled=False)
    assert fitted.modelled is False  # what "(measured)" was printed from
    assert [cost_kind(c) for c in (fitted, measured, SNAPDRAGON_8GEN3)] == ["fitted from a trace", "measured",
                                                                           "modelled"]
