"""Exact resume with LoRA dropout on every projection: grouped q/k/v and gate/up adapters (per-member draws), the
LoRA MLP's down_proj, gate/up rebuilt in backward from the group's recipe, and 2 micro-batches a step. The masks
come from seeds drawn from torch's generator (``ops.dropout``), so a run stopped after step 3 and resumed from its
checkpoint (which restores that generator) must end bit for bit where an uninterrupted run ends, in the loop that
reads every step and in the pipelined one (fused AdamW, read one step late)."""

import json

import pytest
import torch
from train_helpers import SyntheticLoader, sigterm_at_forward, tiny_config, tiny_model

from chronicals.train import train
from chronicals.train.checkpoint import checkpoint_dirs

STEPS, STOP = 6, 3
OVER = dict(train__max_steps=STEPS, train__grad_accum=2, lora__enabled=True, lora__rank=4, lora__dropout=0.2,
            model__recompute=["norm", "swiglu", "gate_up"], schedule__kind="cosine")


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.parametrize("fused", [False, True], ids=["every-step", "pipelined"])
def test_resume_with_lora_dropout_equals_uninterrupted(tmp_path, docs, fused):
    over = dict(OVER, optim__fused=fused)
    straight = tiny_model()
    train(tiny_config(tmp_path / "a", **over), model=straight, train_loader=SyntheticLoader(docs, seed=5))
    groups = [m for m in straight.modules() if m.__dict__.get("lora_qkv") or m.__dict__.get("lora_gate_up")]
    assert len(groups) == 4  # 2 layers x (q/k/v, gate/up): the grouped path ran

    cfg = tiny_config(tmp_path / "b", train__resume="auto", **over)
    first = tiny_model()
    sigterm_at_forward(first, 2 * STOP)  # step 3's second micro-batch
    done = train(cfg, model=first, train_loader=SyntheticLoader(docs, seed=5))
    assert (done.status, done.step) == ("interrupted", STOP)
    assert [p.name for p in checkpoint_dirs(tmp_path / "b" / "run")] == [f"step-{STOP:06d}"]
    torch.manual_seed(999)  # the generator at restart must not matter: the checkpoint's is restored
    resumed = tiny_model()
    assert train(cfg, model=resumed, train_loader=SyntheticLoader(docs, seed=5)).step == STEPS

    assert _losses(tmp_path / "b" / "run") == _losses(tmp_path / "a" / "run")
    for n, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[n]), n


def test_dropout_changes_the_run(tmp_path, docs):
    """The test above is not vacuous: the same run without dropout ends elsewhere after the same steps."""
    ends = []
    for p in (0.2, 0.0):
        model = tiny_model()
        train(tiny_config(tmp_path / str(p), **dict(OVER, lora__dropout=p, train__max_steps=2)), model=model,
              train_loader=SyntheticLoader(docs, seed=5))
        ends.append(model.state_dict())
    assert any(not torch.equal(ends[0][n], ends[1][n]) for n in ends[0] if "lora_A" in n)
