"""The training loop on a tiny random decoder: accumulation, learning, exact resume, signals, NaN."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import time
import warnings

import pytest
import torch

import chronicals.train.checkpoint as ckpt
from chronicals.data import PackedBatch
from chronicals.train import TrainingDiverged, accumulate_gradients, train
from chronicals.train.checkpoint import checkpoint_dirs
from chronicals.train.step import batch_loss_sum

from train_helpers import SyntheticLoader, sigterm_at_forward, strict_json, synthetic_docs, tiny_config, tiny_model


def merge_batches(batches: list[PackedBatch]) -> PackedBatch:
    """One batch holding every row of ``batches`` (cu_seqlens shifted by the preceding rows' tokens)."""
    cus, offset = [], 0
    for b in batches:
        cus.append(b.cu_seqlens[(1 if cus else 0):].long() + offset)
        offset += b.input_ids.numel()
    cat = lambda name: torch.cat([getattr(b, name) for b in batches])  # noqa: E731
    return PackedBatch(cat("input_ids"), cat("position_ids"), cat("shift_labels"), torch.cat(cus).int(),
                       max(b.max_seqlen for b in batches), sum(b.num_loss_tokens for b in batches))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_accumulation_equals_one_big_batch():
    """k micro-batches with loss_sum_i / N_total == one batch of all of them (fp64 weights)."""
    micro = SyntheticLoader(synthetic_docs(30, seed=3), batch_size=1, row_len=29, shuffle=False).batches[:3]
    assert len({b.num_loss_tokens for b in micro}) > 1  # unequal counts, or the test could not fail
    model = tiny_model(dtype=torch.float64)
    loss_k, n_k = accumulate_gradients(model, micro, torch.device("cpu"))
    g_k = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_1, n_1 = accumulate_gradients(model, [merge_batches(micro)], torch.device("cpu"))
    g_1 = _grads(model)
    assert n_k == n_1 == sum(b.num_loss_tokens for b in micro)
    # the loss head computes in fp32 (cross_entropy_ref upcasts to float32): fp32 rounding is the floor
    torch.testing.assert_close(loss_k, loss_1, rtol=1e-6, atol=0)
    worst = max(((g_k[n] - g_1[n]).abs().max() / g_1[n].abs().max()).item() for n in g_1)
    assert worst < 1e-5
    # per-micro-batch means (the common bug) are measurably different
    model.zero_grad(set_to_none=True)
    for b in micro:
        accumulate_gradients(model, [b], torch.device("cpu"))[0]
    naive = {n: p.grad / len(micro) for n, p in model.named_parameters()}
    assert max(((naive[n] - g_1[n]).abs().max() / g_1[n].abs().max()).item() for n in g_1) > 100 * max(worst, 1e-9)


def test_accumulated_gradients_are_those_of_the_mean_loss_per_token():
    micro = SyntheticLoader(synthetic_docs(30, seed=3), batch_size=1, row_len=29, shuffle=False).batches[:2]
    cpu = torch.device("cpu")
    model = tiny_model(dtype=torch.float64)
    accumulate_gradients(model, micro, cpu)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    (sum(batch_loss_sum(model, b, cpu) for b in micro) / sum(b.num_loss_tokens for b in micro)).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-9, msg=name)


def test_a_given_count_divides_the_loss_and_is_returned():
    b = SyntheticLoader(synthetic_docs(4, seed=1), batch_size=1, row_len=29, shuffle=False).batches[0]
    cpu = torch.device("cpu")
    model = tiny_model(dtype=torch.float64)
    own, n_own = accumulate_gradients(model, [b], cpu)
    halved, n = accumulate_gradients(model, [b], cpu, count=2 * b.num_loss_tokens)
    assert (n_own, n) == (b.num_loss_tokens, 2 * b.num_loss_tokens)
    torch.testing.assert_close(halved, own / 2)


def test_a_step_without_loss_tokens_gives_zero_loss_and_zero_gradients():
    """Every label ignored in every micro-batch: loss 0 and zero gradients, as reduction="mean" of an all-ignored
    batch is 0, not 0 / 0 = NaN (untested: a mutation walk)."""
    from dataclasses import replace

    b = SyntheticLoader(synthetic_docs(4, seed=1), batch_size=1, row_len=29, shuffle=False).batches[0]
    b = replace(b, shift_labels=torch.full_like(b.shift_labels, -100), num_loss_tokens=0)
    for count in (None, torch.tensor(0)):  # one process's int count; data parallelism's all-ranks device count
        model = tiny_model()
        loss, n = accumulate_gradients(model, [b, b], torch.device("cpu"), count=count)
        assert int(n) == 0 and loss.item() == 0.0
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_tiny_run_lowers_loss(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=30, optim__lr=1e-2, logging__plot=True, train__save_final=True)
    model = tiny_model()
    res = train(cfg, model=model, train_loader=SyntheticLoader(docs, seed=0),
                eval_loader=SyntheticLoader(docs, shuffle=False))
    assert res.status == "completed" and res.step == 30
    assert res.eval_loss_after < 0.6 * res.eval_loss_before, (res.eval_loss_before, res.eval_loss_after)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train_recs] == list(range(1, 31))
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in train_recs)
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    assert (tmp_path / "run" / "config.yaml").is_file()
    from chronicals import load_model  # full fine-tuning writes a Hugging Face directory holding the trained weights

    reloaded, _ = load_model(res.final_dir, tokenizer=False)
    assert res.final_dir.name == "model"
    trained = model.state_dict()
    assert all(torch.equal(trained[k], v) for k, v in reloaded.state_dict().items())


def _sigterm_at(k):
    def on_step(step, rec):
        if step == k:
            os.kill(os.getpid(), signal.SIGTERM)
    return on_step


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_after_sigterm_equals_uninterrupted(tmp_path, docs, lora):
    """SIGTERM at step 5 writes a checkpoint and returns; resume=auto then ends bit-identical to a straight run.

    13 steps x 2 micro-batches cross an epoch boundary (7 batches per epoch); LoRA runs with dropout so the
    restored RNG matters.
    """
    over = dict(train__max_steps=13, train__grad_accum=2, lora__enabled=lora, lora__rank=4, lora__dropout=0.1,
                lora__targets=["q_proj", "v_proj", "down_proj"], schedule__kind="cosine")
    straight = tiny_model()
    cfg_a = tiny_config(tmp_path / "a", **over)
    train(cfg_a, model=straight, train_loader=SyntheticLoader(docs, seed=5))

    cfg_b = tiny_config(tmp_path / "b", train__resume="auto", **over)
    first = train(cfg_b, model=tiny_model(), train_loader=SyntheticLoader(docs, seed=5), on_step=_sigterm_at(5))
    assert first.status == "interrupted" and first.step == 5
    assert [p.name for p in checkpoint_dirs(tmp_path / "b" / "run")] == ["step-000005"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    torch.manual_seed(1234)  # a different global RNG at restart must not matter
    resumed_model = tiny_model()
    second = train(cfg_b, model=resumed_model, train_loader=SyntheticLoader(docs, seed=5))
    assert second.status == "completed" and second.step == 13
    a, b = straight.state_dict(), resumed_model.state_dict()
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, 14))


def test_a_last_step_that_ruins_the_model_is_a_divergence_not_a_success(tmp_path, docs):
    """The guard checks each step before its update: the last update was never checked, so a run whose last step
    left NaN weights exited 0 "completed", saved its final model, and wrote "eval_loss": NaN into metrics.jsonl,
    which strict JSON readers refuse (a metrics walk). Now TrainingDiverged, null in the file, the curve drawn."""
    model = tiny_model()

    def poison(step, rec):
        if step == 2:  # after the last step's update, as a huge lr leaves it
            with torch.no_grad():
                model.model.norm.weight.fill_(float("nan"))

    cfg = tiny_config(tmp_path, train__max_steps=2, train__save_final=True, logging__plot=True)
    with pytest.raises(TrainingDiverged, match=r"held-out loss is nan after step 2: the weights there are not finite "
                                               r"\(1 tensor, e.g. model.norm.weight\); the final model is not written"):
        train(cfg, model=model, train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4], shuffle=False),
              on_step=poison)
    run = tmp_path / "run"
    assert not (run / "model").exists() and (run / "loss.png").is_file()
    records = [strict_json(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["tag"] == "after" and records[-1]["eval_loss"] is None


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, docs):
    model = tiny_model()

    def poison(step, rec):
        if step == 2:  # after step 2's checkpoint: step 3's loss is NaN
            with torch.no_grad():
                model.model.norm.weight.fill_(float("nan"))

    cfg = tiny_config(tmp_path, train__save_every=2, train__max_steps=6, logging__plot=True)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3.*step-000002.*resume=auto continues from "
                       r"it.*resume=none starts over"):
        train(cfg, model=model, train_loader=SyntheticLoader(docs), on_step=poison)
    dirs = checkpoint_dirs(tmp_path / "run")
    assert [p.name for p in dirs] == ["step-000002"]
    # the curve up to the divergence is drawn (only the closing evaluation's divergence was tested: a mutation walk)
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    state = torch.load(dirs[0] / "state.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.parametrize("fused", [False, True])  # read before the update / one step late (pipelined)
def test_nan_weights_before_the_first_step_are_named(tmp_path, docs, fused):
    """A model that starts with NaN/inf weights (a damaged checkpoint) was told to lower optim.lr."""
    model = tiny_model()
    with torch.no_grad():
        dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"].view(-1)[3] = float("inf")
    cfg = tiny_config(tmp_path, train__max_steps=2, optim__fused=fused)
    with pytest.raises(TrainingDiverged, match=r"at step 1, the first this process ran, and the model's weights held "
                                               r"NaN/inf before any update: 1 tensor, e.g. model\.layers\.0\.mlp\.down_proj"):
        train(cfg, model=model, train_loader=SyntheticLoader(docs))


@pytest.mark.parametrize("fused", ["false", "true"])
def test_damaged_base_weights_at_a_resumed_first_step_are_named(tmp_path, docs, fused):
    """A LoRA run resumed onto a base model whose weights hold inf (a damaged download) names the damaged tensors at
    the first step this process runs (step 2), not only at the run's step 1."""
    over = dict(lora__enabled=True, lora__rank=4, lora__targets=["q_proj", "v_proj"], optim__fused=fused)
    train(tiny_config(tmp_path, train__max_steps=1, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    model = tiny_model()
    with torch.no_grad():
        dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"].view(-1)[3] = float("inf")
    with pytest.raises(TrainingDiverged, match=r"at step 2, the first this process ran, and the model's weights held "
                                               r"NaN/inf before any update: 1 tensor, e.g. model\.layers\.0\.mlp"):
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto", **over), model=model,
              train_loader=SyntheticLoader(docs))


def test_keep_last_checkpoints(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__save_every=1, train__keep_last=2, train__max_steps=4)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-000003", "step-000004"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("max_steps, sigterm", [(4, None), (8, 4)], ids=["last-step", "stopped"])
def test_an_async_checkpoint_in_flight_is_the_results(tmp_path, docs, monkeypatch, max_steps, sigterm):
    """train.async_save with slow writes: a run whose last step is a save_every step, and a SIGTERM at a save_every
    step, both return (and name in the summary and the stop line) that step's checkpoint, written by the time
    train() returns. Taking the newest published checkpoint instead gave the one before while the write was in
    flight (step-000002)."""
    real = ckpt.write_checkpoint

    def slow(*a, **k):
        time.sleep(0.3)
        return real(*a, **k)
    monkeypatch.setattr(ckpt, "write_checkpoint", slow)
    model = tiny_model() if sigterm is None else sigterm_at_forward(tiny_model(), sigterm)
    res = train(tiny_config(tmp_path, train__max_steps=max_steps, train__save_every=2, train__async_save=True),
                model=model, train_loader=SyntheticLoader(docs))
    assert (res.status, res.step) == ("completed" if sigterm is None else "interrupted", 4)
    assert res.checkpoint == tmp_path / "run" / "checkpoints" / "step-000004" and res.checkpoint.is_dir()


def test_schedule_shapes():
    from chronicals.train.optim import lr_factor

    assert lr_factor(0, 10, 2, "cosine", 0.1) == 0.5
    assert lr_factor(1, 10, 2, "cosine", 0.1) == 1.0
    assert lr_factor(9, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 2, "linear", 0.0) == pytest.approx(0.0)
    assert lr_factor(5, 10, 2, "constant", 0.1) == 1.0
    mid = lr_factor(2 + 7 // 2, 10, 2, "cosine", 0.0)
    assert math.isclose(mid, 0.5 * (1 + math.cos(math.pi * 3 / 7)))


def test_tokenization_cache_defaults_under_the_chronicals_cache(monkeypatch, tmp_path):
    from chronicals.train.setup import tokenization_cache_dir

    monkeypatch.setenv("CHRONICALS_CACHE", str(tmp_path))
    assert tokenization_cache_dir("") == tmp_path / "data"
    assert tokenization_cache_dir("none") is None
    assert tokenization_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tokenization_cache_dir("~/mine") == tmp_path / "mine"  # not a folder named '~' in the working directory


def test_corrupt_checkpoint_is_a_clear_error_naming_the_one_before(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=3, train__save_every=1, train__keep_last=3)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    *_, before, last = checkpoint_dirs(cfg.train.out_dir)
    (last / "state.pt").write_bytes((last / "state.pt").read_bytes()[:100])  # truncated after it was written
    cfg2 = tiny_config(tmp_path, train__max_steps=4, train__save_every=1, train__keep_last=3, train__resume="auto")
    with pytest.raises(ValueError, match=rf"cannot be read .* truncated or corrupt: move {last} away, and "
                                         rf"train.resume=auto resumes from {before}"):
        train(cfg2, model=tiny_model(), train_loader=SyntheticLoader(docs))
    # other damage: garbage bytes (an UnpicklingError), a pickle of something else
    for damage in (b"\x80\x02garbage" * 10, __import__("pickle").dumps({"step": 3})):
        (last / "state.pt").write_bytes(damage)
        with pytest.raises(ValueError, match=rf"state.pt is not the zip archive torch.save writes; it is truncated or "
                                             rf"corrupt: move {last} away"):
            train(cfg2, model=tiny_model(), train_loader=SyntheticLoader(docs))


def test_corrupt_checkpoint_named_by_train_resume_points_to_the_one_before_it(tmp_path, docs):
    """train.resume=PATH: moving it away does nothing for the next run (resume=auto looks in out_dir), so the fix
    names the checkpoint before it as train.resume."""
    cfg = tiny_config(tmp_path / "a", train__max_steps=3, train__save_every=1, train__keep_last=3)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs))
    *_, before, last = checkpoint_dirs(cfg.train.out_dir)
    (last / "state.pt").write_bytes((last / "state.pt").read_bytes()[:100])
    cfg2 = tiny_config(tmp_path / "b", train__max_steps=4, train__resume=str(last))
    with pytest.raises(ValueError, match=rf"truncated or corrupt: resume from the checkpoint before it "
                                         rf"\(train.resume={before}\), or set train.resume=none"):
        train(cfg2, model=tiny_model(), train_loader=SyntheticLoader(docs))
    # a damaged checkpoint with a newer one beside it: the one before it, not the newest other (step-3 was named)
    first, middle, _ = checkpoint_dirs(cfg.train.out_dir)
    (middle / "state.pt").write_bytes((middle / "state.pt").read_bytes()[:100])
    with pytest.raises(ValueError, match=rf"resume from the checkpoint before it \(train.resume={first}\)"):
        train(tiny_config(tmp_path / "c", train__max_steps=4, train__resume=str(middle)), model=tiny_model(),
              train_loader=SyntheticLoader(docs))


# ---- the pipelined loop (fused AdamW, no on_step): step k read on the host while step k+1 runs ----
def _train_records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def _at_forward(model, k: int, action):
    """Calls ``action(output)`` on the model's final norm output at its k-th forward call (1-based); returns it."""
    calls = [0]

    def hook(module, args, out):
        calls[0] += 1
        return action(out) if calls[0] == k else out
    return model.model.norm.register_forward_hook(hook)


def test_pipelined_loop_equals_reading_every_step(tmp_path, docs, caplog):
    """Fused AdamW without on_step reads each step one step late; the weights, losses, gradient norms and
    token counts equal the run that reads every step before its update (an on_step callback forces that),
    across an evaluation, a checkpoint and the last step."""
    over = dict(optim__fused="true", train__max_steps=7, train__save_every=3, eval__every=2)
    models = {}
    for how, on_step in (("pipelined", None), ("every step", lambda step, rec: None)):
        models[how] = tiny_model()
        with caplog.at_level("INFO", logger="chronicals.train"):
            caplog.clear()
            train(tiny_config(tmp_path / how, **over), model=models[how], train_loader=SyntheticLoader(docs, seed=2),
                  eval_loader=SyntheticLoader(docs[:6], shuffle=False), on_step=on_step)
        late = "step metrics: read one step late" in caplog.text
        assert late == (how == "pipelined"), caplog.text
    a, b = (_train_records(tmp_path / how / "run") for how in ("pipelined", "every step"))
    assert [r["step"] for r in a] == list(range(1, 8))
    # each interval evaluation runs once its step is read and checked: its record follows that step's
    for how in ("pipelined", "every step"):
        recs = [json.loads(line) for line in (tmp_path / how / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [(r["kind"][0], r["step"]) for r in recs] == [
            ("e", 0), ("t", 1), ("t", 2), ("e", 2), ("t", 3), ("t", 4), ("e", 4), ("t", 5), ("t", 6), ("e", 6),
            ("t", 7), ("e", 7)], how
    for key in ("loss", "grad_norm", "loss_tokens", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in a)
    for n, v in models["pipelined"].state_dict().items():
        assert torch.equal(v, models["every step"].state_dict()[n]), n
    # every 3 steps and at the end, the last 2 kept
    assert [p.name for p in checkpoint_dirs(tmp_path / "pipelined" / "run")] == ["step-000006", "step-000007"]


def test_pipelined_nan_step_is_not_applied_and_stops(tmp_path, docs):
    """Step 3's loss is NaN: its update is skipped on the device and the stop comes while step 4 is queued,
    before step 4's update; the weights are step 2's (the checkpoint's), and metrics end at step 2."""
    model = tiny_model()
    # the final norm returns (normed, residual): poison the normed rows
    _at_forward(model, 3, lambda out: (out[0] * float("nan"), *out[1:]))
    cfg = tiny_config(tmp_path, optim__fused="true", train__save_every=2, train__max_steps=6)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3.*step-000002"):
        train(cfg, model=model, train_loader=SyntheticLoader(docs))
    dirs = checkpoint_dirs(tmp_path / "run")
    assert [p.name for p in dirs] == ["step-000002"]
    saved = torch.load(dirs[0] / "state.pt", weights_only=False)["model"]
    for n, v in model.state_dict().items():
        assert torch.isfinite(v).all() and torch.equal(v, saved[n]), n
    assert [r["step"] for r in _train_records(tmp_path / "run")] == [1, 2]


def test_a_pipelined_nan_at_a_save_step_is_not_checkpointed(tmp_path, docs):
    """Step 4's loss is NaN and step 4 is a save_every step: the step is read and checked before its checkpoint, so
    the run stops with step 2's checkpoint as the last good one and metrics end at step 3. Checkpointed first,
    "step-000004" held step 3's weights under step 4's name and the error named it as the last good one."""
    model = tiny_model()
    _at_forward(model, 4, lambda out: (out[0] * float("nan"), *out[1:]))
    cfg = tiny_config(tmp_path, optim__fused="true", train__save_every=2, train__max_steps=6, train__keep_last=5)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 4.*step-000002"):
        train(cfg, model=model, train_loader=SyntheticLoader(docs))
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-000002"]
    assert [r["step"] for r in _train_records(tmp_path / "run")] == [1, 2, 3]


def test_pipelined_sigterm_stops_after_that_step_and_resumes_exactly(tmp_path, docs):
    """A SIGTERM during step 5's forward: the pipelined loop reads step 5, checkpoints it and returns;
    resume=auto then ends bit-identical to a straight run."""
    over = dict(optim__fused="true", train__max_steps=9)
    straight = tiny_model()
    train(tiny_config(tmp_path / "a", **over), model=straight, train_loader=SyntheticLoader(docs, seed=4))

    def sigterm(out):
        os.kill(os.getpid(), signal.SIGTERM)
        return out
    first_model = tiny_model()
    _at_forward(first_model, 5, sigterm)
    cfg = tiny_config(tmp_path / "b", train__resume="auto", **over)
    first = train(cfg, model=first_model, train_loader=SyntheticLoader(docs, seed=4))
    assert (first.status, first.step) == ("interrupted", 5)
    assert [p.name for p in checkpoint_dirs(tmp_path / "b" / "run")] == ["step-000005"]
    resumed = tiny_model()
    assert train(cfg, model=resumed, train_loader=SyntheticLoader(docs, seed=4)).step == 9
    for n, v in straight.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[n]), n
    assert [r["step"] for r in _train_records(tmp_path / "b" / "run")] == list(range(1, 10))


def test_resume_with_another_lora_config_names_what_differs(tmp_path, docs):
    """A checkpoint written with lora.rank=4 resumed with rank 8 (other shapes), or a full fine-tune's resumed
    under LoRA (trainable parameters it lacks): one clear error naming the differing keys, not a copy_ traceback;
    said before the model is touched (check_resume_adapter). load_checkpoint itself, called on such a model, names
    the tensors and the keys."""
    from chronicals.lora import apply_lora
    from chronicals.train.checkpoint import load_checkpoint

    over = dict(lora__enabled=True, lora__targets=["q_proj", "v_proj"], train__save_every=1, train__max_steps=1)
    train(tiny_config(tmp_path, lora__rank=4, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    again = dict(over, train__resume="auto", train__max_steps=2)
    with pytest.raises(ValueError, match=r"holds LoRA adapters trained with lora.rank=4 \(this run: 8\)"):
        train(tiny_config(tmp_path, lora__rank=8, **again), model=tiny_model(), train_loader=SyntheticLoader(docs))
    model = tiny_model()
    apply_lora(model, r=8, target_modules=("q_proj", "v_proj"))
    step1 = tmp_path / "run" / "checkpoints" / "step-000001"
    cfg = tiny_config(tmp_path, lora__rank=8, **again).to_dict()
    with pytest.raises(ValueError, match=r"has other shapes .*lora_A.weight \(4, 24\) vs the model's \(8, 24\).*"
                                         r"another model or lora config: lora.rank=4 \(this run: 8\); resume with that config, or "
                                         r"start over \(another train.out_dir, or train.resume=none\)"):
        load_checkpoint(step1, model, torch.optim.AdamW(model.parameters()), None, config=cfg)
    full = tmp_path / "full"
    train(tiny_config(full, lora__enabled=False, train__save_every=1, train__max_steps=1), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    with pytest.raises(ValueError, match=r"was written by a full fine-tuning run \(lora.enabled false\), and this run "
                                         r"is a LoRA run \(lora.enabled true\)"):
        train(tiny_config(full, lora__rank=4, **again), model=tiny_model(), train_loader=SyntheticLoader(docs))


def test_resume_over_other_batches_warns(tmp_path, docs, caplog):
    train(tiny_config(tmp_path, train__save_every=1, train__max_steps=1), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__resume="auto", train__max_steps=2, data__batch_size=2), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "written with data.batch_size=4 (this run: 2): its data position refers to other batches" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__resume="auto", train__max_steps=3, data__batch_size=2), model=tiny_model(),
              train_loader=SyntheticLoader(docs))  # from the end checkpoint of the run above (batch_size 2)
    assert "data position" not in caplog.text


def test_resume_applies_this_runs_optimizer_settings(tmp_path, docs, caplog):
    """A resume with another optim.lr (the divergence message's advice) trains on with it: the lr of the resumed
    steps equals a straight run's at that lr, and the change is named in a warning."""
    over = dict(train__max_steps=4, optim__lr=2e-3, optim__weight_decay=0.1)
    train(tiny_config(tmp_path / "a", **dict(over, train__max_steps=2, optim__lr=1e-3, optim__weight_decay=0.0)),
          model=tiny_model(),
          train_loader=SyntheticLoader(docs))  # its end checkpoint: step 2
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path / "a", **over, train__resume="auto"), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert "resumed at step 2 with other settings than the checkpoint's run: optim.lr=0.001 (this run: 0.002)" \
        in caplog.text and "optim.weight_decay=0.0 (this run: 0.1)" in caplog.text
    train(tiny_config(tmp_path / "b", **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    resumed, straight = (_train_records(tmp_path / d / "run") for d in ("a", "b"))
    assert [r["lr"] for r in resumed[2:]] == [r["lr"] for r in straight[2:]]
    assert resumed[1]["lr"] != straight[1]["lr"]  # step 2 ran at the old lr


@pytest.mark.parametrize("first, then", [("false", "true"), ("true", "false")])
def test_a_resume_under_another_optim_fused_runs_this_runs_path(tmp_path, docs, first, then):
    """The checkpoint's optimizer groups carried the old run's fused flag: fused=false then true ran torch's
    unfused AdamW, which refused the loop's found_inf ("Expected grad_scale and found_inf to be None", exit 4); the
    other way the fused kernel stayed (a full fine-tuning walk). This run's optim.fused applies: both ways train on."""
    over = dict(train__max_steps=4, train__save_every=2)
    train(tiny_config(tmp_path / "a", **over, optim__fused=first), model=tiny_model(),
          train_loader=SyntheticLoader(docs), on_step=lambda step, rec: step == 2 and os.kill(os.getpid(), signal.SIGINT))
    resumed = tiny_model()
    res = train(tiny_config(tmp_path / "a", **over, optim__fused=then, train__resume="auto"), model=resumed,
                train_loader=SyntheticLoader(docs))
    assert res.start_step == 2 and res.step == 4 and res.status == "completed"


def test_resume_at_or_past_the_end(tmp_path, docs, caplog):
    """A finished out_dir: resume=auto finds its end checkpoint and trains nothing (metrics.jsonl unchanged, no
    second closing evaluation); a checkpoint past this run's steps is refused."""
    cfg = tiny_config(tmp_path, train__max_steps=3, train__save_final=True)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    run = tmp_path / "run"
    metrics = (run / "metrics.jsonl").read_text()
    again = tiny_config(tmp_path, train__max_steps=3, train__save_final=True, train__resume="auto")
    with caplog.at_level("WARNING", logger="chronicals.train"):
        res = train(again, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    assert "is this run's last step (3 of 3): nothing to train" in caplog.text
    assert res.status == "completed" and res.step == 3 and res.start_step == 3 and res.final_dir == run / "model"
    assert (run / "metrics.jsonl").read_text() == metrics
    with pytest.raises(ValueError, match=r"step-000003 is at step 3, past this run's 2 steps; raise train.max_steps"):
        train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto"), model=tiny_model(),
              train_loader=SyntheticLoader(docs))


def test_a_run_stopped_in_its_last_step_gets_its_closing_evaluation_on_resume(tmp_path, docs):
    """SIGTERM during the last step checkpoints it and returns "interrupted" before the closing evaluation;
    resume=auto then found the run done and never ran it: metrics.jsonl lacked the "after" record and the result
    its held-out losses. Now the resumed run logs what the uninterrupted run did."""
    over = dict(train__max_steps=3)
    straight = train(tiny_config(tmp_path / "a", **over), model=tiny_model(), train_loader=SyntheticLoader(docs),
                     eval_loader=SyntheticLoader(docs[:4], shuffle=False))
    cfg = tiny_config(tmp_path / "b", train__resume="auto", **over)
    first = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs),
                  eval_loader=SyntheticLoader(docs[:4], shuffle=False), on_step=_sigterm_at(3))
    assert (first.status, first.step, first.eval_loss_after) == ("interrupted", 3, None)
    resumed = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs),
                    eval_loader=SyntheticLoader(docs[:4], shuffle=False))
    assert resumed.start_step == 3 and resumed.eval_loss_after == straight.eval_loss_after
    assert resumed.eval_loss_before == straight.eval_loss_before

    def evals(run):
        return [(r["step"], r["tag"], r["eval_loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text()
                                                                   .splitlines()) if r["kind"] == "eval"]
    assert evals(tmp_path / "b" / "run") == evals(tmp_path / "a" / "run")
    assert [r["step"] for r in _train_records(tmp_path / "b" / "run")] == [1, 2, 3]
    metrics = (tmp_path / "b" / "run" / "metrics.jsonl").read_text()  # a third call: done, nothing logged again
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    assert (tmp_path / "b" / "run" / "metrics.jsonl").read_text() == metrics


def test_a_finished_run_found_by_resume_writes_its_own_final_directory(tmp_path, docs):
    """Run A wrote model/; run B (resume=none, another lr, train.save_final=false) finished; resume=auto with
    save_final then found B's last checkpoint and returned A's model/ as B's, unchanged."""
    from safetensors.torch import load_file

    train(tiny_config(tmp_path, train__max_steps=3, train__save_final=True), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    run = tmp_path / "run"
    first = load_file(run / "model" / "model.safetensors")
    train(tiny_config(tmp_path, train__max_steps=3, optim__lr=3e-2), model=tiny_model(),
          train_loader=SyntheticLoader(docs))
    res = train(tiny_config(tmp_path, train__max_steps=3, optim__lr=3e-2, train__save_final=True,
                            train__resume="auto"), model=tiny_model(), train_loader=SyntheticLoader(docs))
    assert res.start_step == 3 and res.final_dir == run / "model"
    straight = train(tiny_config(tmp_path, train__max_steps=3, optim__lr=3e-2, train__save_final=True,
                                 train__out_dir=str(tmp_path / "b")), model=tiny_model(),
                     train_loader=SyntheticLoader(docs))
    got, want = load_file(res.final_dir / "model.safetensors"), load_file(straight.final_dir / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], first[k]) for k in first)


def test_a_finished_run_and_a_done_rerun_close_their_metrics_log(tmp_path, docs):
    """A run that trains to its end, then train.resume=<its step-2> into another out_dir, max_steps=2: nothing to
    train; out_dir takes that run's records (its metrics.jsonl opened for them) and gets the closing evaluation.
    Each metrics log is closed before train() returns, not left to the garbage collector (a ResourceWarning naming
    a metrics.jsonl)."""
    gc.collect()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        train(tiny_config(tmp_path / "a", train__max_steps=2, train__save_every=2), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
        gc.collect()
        last = checkpoint_dirs(tmp_path / "a" / "run")[-1]
        b = tiny_config(tmp_path / "b", train__max_steps=2, train__resume=str(last))
        res = train(b, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
        gc.collect()
    assert res.step == 2 and (tmp_path / "b" / "run" / "metrics.jsonl").is_file()
    assert [str(w.message) for w in got if issubclass(w.category, ResourceWarning)
            and "metrics.jsonl" in str(w.message)] == []


def test_a_rerun_that_logs_the_closing_evaluation_closes_its_metrics_log(tmp_path, docs):
    """A rerun that finds the run's last step without its closing ("after") evaluation logs it to metrics.jsonl and
    closes the file before train() returns, not leaving it to the garbage collector (a ResourceWarning naming
    metrics.jsonl)."""
    cfg = tiny_config(tmp_path, train__max_steps=2, train__save_every=2, train__resume="auto")
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines() if '"after"' not in line))
    gc.collect()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
        gc.collect()
    assert res.start_step == 2 and res.eval_loss_after is not None
    assert [json.loads(line).get("tag") for line in metrics.read_text().splitlines()][-1] == "after"
    assert [str(w.message) for w in got if issubclass(w.category, ResourceWarning)
            and "metrics.jsonl" in str(w.message)] == []


class _FailingEval(SyntheticLoader):
    def __iter__(self):
        raise ValueError("held-out data went bad")


def test_a_new_run_that_fails_before_logging_keeps_the_old_runs_record(tmp_path, docs):
    """resume=none over a finished run: until the new run logs its first record, the old metrics.jsonl and
    config.yaml stay as they were (a failure in the first evaluation, a Ctrl-C during setup)."""
    train(tiny_config(tmp_path, train__max_steps=2), model=tiny_model(), train_loader=SyntheticLoader(docs))
    run = tmp_path / "run"
    before = {n: (run / n).read_text() for n in ("metrics.jsonl", "config.yaml")}
    with pytest.raises(ValueError, match="held-out data went bad"):
        train(tiny_config(tmp_path, train__max_steps=5, optim__lr=1e-4), model=tiny_model(),
              train_loader=SyntheticLoader(docs), eval_loader=_FailingEval(docs[:4]))
    assert {n: (run / n).read_text() for n in before} == before


def test_a_new_run_removes_the_old_runs_checkpoints_and_final_model_once(tmp_path, docs, caplog):
    """resume=none over a finished run with checkpoints at steps 2 and 4 and a final model: the new run removes
    them at its first record and says so once. Its own step-2, 4 and 6 checkpoints then stay (keep_last=5) and its
    own model/ is written. With the stale lists kept, each later save removed the new run's step-2 or step-4
    checkpoint again as "another run's" and repeated the final-model warning."""
    over = dict(train__save_every=2, train__keep_last=5, train__save_final=True)
    train(tiny_config(tmp_path, train__max_steps=4, **over), model=tiny_model(), train_loader=SyntheticLoader(docs))
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=6, **over), model=tiny_model(seed=1),
              train_loader=SyntheticLoader(docs))
    assert [d.name for d in checkpoint_dirs(tmp_path / "run")] == ["step-000002", "step-000004", "step-000006"]
    said = [r.getMessage() for r in caplog.records if "another run's final" in r.getMessage()]
    assert len(said) == 1, said
    assert (tmp_path / "run" / "model" / "config.json").is_file()


def test_a_warmup_as_long_as_the_run_is_named_with_where_the_peak_lands(tmp_path, docs, caplog):
    """warmup 5 over a 3-step run becomes ceil(3 / 10) = 1 step, so the run still decays: steps 1, 2, 3 run at
    1, 1 and min_lr_ratio (0.1) of the peak (cosine from step 1 to the last step)."""
    with caplog.at_level("WARNING", logger="chronicals.train"):
        train(tiny_config(tmp_path, train__max_steps=3, schedule__warmup_steps=5, optim__lr=1e-3), model=tiny_model(),
              train_loader=SyntheticLoader(docs))
    assert ("warming up over 1 step(s) instead (1/10 of the run, rounded up), so the lr reaches its peak at step 1"
            in caplog.text)
    assert [r["lr"] for r in _train_records(tmp_path / "run")] == pytest.approx([1e-3, 1e-3, 1e-4])


def test_a_divergence_before_the_first_checkpoint_does_not_ask_for_a_setting_already_set(tmp_path, docs):
    """It said "train.save_every=N writes them" with train.save_every=4 set, the NaN coming at step 1."""
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[0, 0] = 1e38  # finite weights whose first loss overflows
    cfg = tiny_config(tmp_path, train__save_every=4, train__max_steps=6)
    with pytest.raises(TrainingDiverged) as e:
        train(cfg, model=model, train_loader=SyntheticLoader(docs))
    assert "No checkpoint was written before it (one is written every train.save_every steps, and at the end)" in \
        str(e.value) and "save_every=N" not in str(e.value), str(e.value)


def test_the_gradient_norm_of_no_gradient_is_zero():
    """A step in which no parameter got a gradient has norm 0 (and clipping changes nothing): untested before (a
    mutation walk: returning 1 survived)."""
    from chronicals.train.step import clip_grad_norm, grad_norm_fp32

    p = torch.nn.Parameter(torch.ones(3))
    assert float(grad_norm_fp32([p])) == 0.0
    assert float(clip_grad_norm([p], 1.0)) == 0.0 and p.grad is None and torch.equal(p.detach(), torch.ones(3))


def test_a_stop_signal_during_an_interval_evaluation_checkpoints_without_finishing_it(tmp_path, docs):
    """SIGTERM while the held-out set of step N was scored waited for the whole evaluation (51 s against 0.3 s steps
    in a concurrency walk) before the checkpoint: past a supervisor's grace period (Kubernetes: 30 s) the SIGKILL came
    first and every step since the last checkpoint was lost. The evaluation is abandoned (no record for it), the
    finished step checkpointed at once."""
    import json

    from train_helpers import sigterm_at_forward

    held = SyntheticLoader(synthetic_docs(60, seed=5), shuffle=False)
    e = len(held)
    assert e >= 6
    model = tiny_model()
    forwards = [0]
    model.model.norm.register_forward_hook(lambda m, a, out: forwards.__setitem__(0, forwards[0] + 1))
    sigterm_at_forward(model, e + 2 + 2)  # the "before" pass, steps 1 and 2, then step 2's evaluation's 2nd batch
    cfg = tiny_config(tmp_path, train__max_steps=6, eval__every=2)
    res = train(cfg, model=model, train_loader=SyntheticLoader(docs), eval_loader=held)
    assert res.status == "interrupted" and res.step == 2 and res.checkpoint.name == "step-000002"
    assert forwards[0] == e + 2 + 2  # the evaluation stopped at the batch the signal came in
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("tag") for r in recs if r["kind"] == "eval"] == ["before"]


def test_a_rerun_after_a_stop_in_the_closing_evaluation_says_it_finishes_the_run(tmp_path, docs, caplog):
    """Stopped in its closing evaluation or final save, the rerun completed the run (as the stop's message promised)
    but warned "nothing to train; ... set train.resume=none to start over" (a concurrency walk)."""
    import json
    import shutil

    cfg = tiny_config(tmp_path, train__max_steps=3, train__save_final=True, train__resume="auto")
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    run = tmp_path / "run"
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs if r.get("tag") != "after"))
    shutil.rmtree(run / "model")  # as a stop before the final save leaves it
    with caplog.at_level("INFO", logger="chronicals.train"):
        res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    assert "is this run's last step (3 of 3): the run stopped before its end; finishing it: its closing " \
           "evaluation, its final model" in caplog.text
    assert "nothing to train" not in caplog.text and "start over" not in caplog.text
    assert res.status == "completed" and res.eval_loss_after is not None and (run / "model").is_dir()


def test_a_resume_over_a_before_record_without_its_loss_goes_on(tmp_path, docs):
    """A "before" evaluation record without eval_loss (a hand-edited or another tool's metrics.jsonl) gives no
    before-loss on resume, not a KeyError (exit 4; untested: a mutation walk)."""
    import json

    cfg = tiny_config(tmp_path, train__max_steps=2, train__save_every=1)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    path = tmp_path / "run" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        if r.get("tag") == "before":
            del r["eval_loss"]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = train(tiny_config(tmp_path, train__max_steps=3, train__resume="auto"), model=tiny_model(),
                train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:4]))
    assert res.status == "completed" and res.start_step == 2 and res.eval_loss_before is None
