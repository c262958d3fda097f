"""Row validation, FLOP counting and the worker's spec round trip (no model runs)."""

import math

import pytest

from chronicals.bench.protocol import RunSpec, validate_row
from chronicals.bench.shapes import get_shape, matmul_params, model_config, train_flops_per_token
from chronicals.bench.worker import parse_args, spec_argv


def _row(norms, losses=None):
    return {"contender": "x", "status": None, "grad_norms": norms, "losses": losses or [1.0] * len(norms)}


def test_validate_row_ok_and_min_norm():
    row = validate_row(_row([0.5, 0.25, 2.0]))
    assert row["status"] == "ok" and row["min_grad_norm"] == 0.25


@pytest.mark.parametrize("norms,why", [([1.0, 0.0, 1.0], "gradient norm 0"), ([1.0, math.nan], "not finite"),
                                       ([math.inf, 1.0], "not finite"), ([], "no timed steps")])
def test_validate_row_failed(norms, why):
    row = validate_row(_row(norms))
    assert row["status"] == "FAILED" and why in row["reason"]


def test_validate_row_failed_on_nan_loss_and_keeps_errors():
    assert validate_row(_row([1.0], [math.nan]))["status"] == "FAILED"
    err = {"contender": "x", "status": "OOM", "reason": "out of memory"}
    assert validate_row(dict(err)) == err


def test_flops_match_anchors():
    """ANCHORS.md: 3.10 GFLOP per token for the 0.5B shape at seq 1024 (full), 31.6 for 8B LoRA at 2048."""
    cfg = model_config(get_shape("0.5b"))
    assert train_flops_per_token(cfg, 1024, "full") == pytest.approx(3.10e9, rel=2e-3)
    assert cfg.num_params() == pytest.approx(494e6, rel=2e-3)  # Qwen2.5-0.5B: 494M parameters
    cfg8 = model_config(get_shape("8b"))
    assert train_flops_per_token(cfg8, 2048, "lora") == pytest.approx(31.6e9, rel=2e-3)
    # lora = full - 2 x matmul params, and attention is counted in both
    assert train_flops_per_token(cfg8, 2048, "full") - train_flops_per_token(cfg8, 2048, "lora") == 2 * matmul_params(cfg8)
    with pytest.raises(ValueError, match="not 'full' or 'lora'"):
        train_flops_per_token(cfg, 1024, "qlora")


def test_spec_round_trip_through_worker_flags():
    spec = RunSpec("hf-peft", shape="tiny", rows=3, seq=17, warmup=0, steps=5, device="cpu", checkpointing=True,
                   lr=2.5e-3, layout="packed")
    args = parse_args(["--task", "contender", "--json-out", "x.json", *spec_argv(spec)])
    assert RunSpec(**{k: getattr(args, k) for k in spec.to_dict()}) == spec
    assert spec.loss_tokens == 3 * 16


def test_runspec_rejects_bad_values():
    with pytest.raises(ValueError, match="seq >= 2"):
        RunSpec("x", seq=1)
    with pytest.raises(ValueError, match="layout"):
        RunSpec("x", layout="padded")
    with pytest.raises(ValueError, match="unknown keys"):
        RunSpec.from_dict({"contender": "x", "batch": 3})
