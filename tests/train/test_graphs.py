"""CUDA-graph training step (chronicals.train.graphs): host-side pieces on CPU, capture vs eager on a GPU.

The GPU tests compare, over 3 optimizer steps with 2 micro-batches each, the losses and every gradient of
the graphed step against the eager step on an identical copy of the model (bf16, Triton ops, varlen flash
for packed rows). Run them on the GPU machine with ``pytest tests/train/test_graphs.py``.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from train_helpers import SyntheticLoader, synthetic_docs, tiny_model

from chronicals.bench.contenders import (CONTENDERS, add_chronicals_lora, build_chronicals_model, chronicals_step,
                                         rows_as_packed_batch)
from chronicals.bench.protocol import RunSpec
from chronicals.bench.shapes import get_shape
from chronicals.config import from_dict
from chronicals.train.graphs import (GraphedStep, bind_static_grads, doc_capacity, fill_cu_seqlens_, graph_key,
                                     resolve_cuda_graphs)
from chronicals.train.step import accumulate_gradients, batch_loss_sum

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


# ---------------------------------------------------------------- host-side pieces (CPU)
def test_doc_capacity_is_next_power_of_two_with_floor():
    assert [doc_capacity(n) for n in (1, 16, 17, 32, 33, 1000)] == [16, 16, 32, 32, 64, 1024]
    assert doc_capacity(3, minimum=2) == 4
    with pytest.raises(ValueError, match="at least one document"):
        doc_capacity(0)


def test_fill_cu_seqlens_repeats_last_value():
    out = torch.full((9,), -1, dtype=torch.int32)
    fill_cu_seqlens_(out, torch.tensor([0, 3, 5, 9, 10], dtype=torch.int32))  # the module docstring's example
    assert out.tolist() == [0, 3, 5, 9, 10, 10, 10, 10, 10]
    fill_cu_seqlens_(out, torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 10], dtype=torch.int32))  # exactly full
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10]
    with pytest.raises(ValueError, match="capacity 8"):
        fill_cu_seqlens_(out, torch.arange(11, dtype=torch.int32))


def test_graph_key_rows_and_packed():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert graph_key(rows_as_packed_batch(ids, "rows")) == (3, 7, 0)
    assert graph_key(rows_as_packed_batch(ids, "packed")) == (3, 7, 16)
    loader = SyntheticLoader(synthetic_docs(40, seed=1), batch_size=2, row_len=32, shuffle=False)
    for b in loader.batches:
        key = graph_key(b)
        assert key[:2] == tuple(b.input_ids.shape) and key[2] >= b.cu_seqlens.numel() - 1


def test_padded_cu_seqlens_leave_the_loss_and_grads_unchanged():
    """Zero-length documents appended to cu_seqlens change nothing (reference attention path, CPU)."""
    batch = SyntheticLoader(synthetic_docs(12, seed=3), batch_size=2, row_len=32, shuffle=False).batches[0]
    padded = torch.empty(doc_capacity(batch.cu_seqlens.numel() - 1) + 1, dtype=torch.int32)
    fill_cu_seqlens_(padded, batch.cu_seqlens)
    assert padded.numel() > batch.cu_seqlens.numel()
    model = tiny_model(seed=0)
    out = []
    for cu, max_seqlen in ((batch.cu_seqlens, batch.max_seqlen), (padded, batch.input_ids.shape[1])):
        model.zero_grad(set_to_none=True)
        loss = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=cu, max_seqlen=max_seqlen,
                     shift_labels=batch.shift_labels, reduction="sum")
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    for g0, g1 in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)


def test_bind_static_grads_keeps_eager_semantics():
    ps = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    bufs = [torch.full((3,), 7.0) for _ in range(3)]
    ps[0].grad = None  # after zero_grad(set_to_none=True): bound and zeroed
    ps[1].grad = bufs[1]  # already bound: left as it is (backward accumulates into it)
    ps[2].grad = torch.full((3,), 2.0)  # another tensor: its values move into the buffer
    bind_static_grads(ps, bufs)
    assert all(p.grad is b for p, b in zip(ps, bufs))
    assert [p.grad.tolist() for p in ps] == [[0.0] * 3, [7.0] * 3, [2.0] * 3]


def test_cpu_request_fails_with_the_fix():
    model = tiny_model()
    with pytest.raises(ValueError, match="train.cuda_graphs=false"):
        GraphedStep(model, "cpu")
    with pytest.raises(ValueError, match="model.device=cpu"):
        from_dict({"model": {"device": "cpu"}, "train": {"cuda_graphs": True}})
    with pytest.raises(ValueError, match="checkpointing"):
        from_dict({"model": {"device": "cuda", "checkpointing": True}, "train": {"cuda_graphs": True}})
    assert from_dict({}).train.cuda_graphs == "auto"
    with pytest.raises(ValueError, match="train.cuda_graphs='sometimes' is invalid: expected auto, true or false"):
        from_dict({"train": {"cuda_graphs": "sometimes"}})


@pytest.mark.parametrize("value, want", [(True, "true"), (False, "false"), ("auto", "auto"), ("off", "false"),
                                         ("ON", "true")])
def test_cuda_graphs_setting_is_normalized(value, want):
    assert from_dict({"model": {"device": "cuda"}, "train": {"cuda_graphs": value}}).train.cuda_graphs == want
    assert from_dict({"model": {"device": "cuda"}}, [f"train.cuda_graphs={value}"]).train.cuda_graphs == want


def test_auto_turns_graphs_on_only_where_they_are_checked():
    assert resolve_cuda_graphs("auto", "cuda:0", False, 1)[0] is True
    on, why = resolve_cuda_graphs("auto", "cuda", False, 2)  # checked on 2 GPUs (tests/train/test_distributed.py)
    assert on is True and "2 data-parallel ranks" in why
    for args, reason in ((("cpu", False, 1), "need a GPU"), (("cuda", True, 1), "checkpointing"),
                         (("cuda", 3, 1), "checkpointing"), (("cpu", False, 2), "need a GPU")):
        on, why = resolve_cuda_graphs("auto", *args)
        assert on is False and reason in why
    assert resolve_cuda_graphs("true", "cpu", False, 1)[0] is True  # GraphedStep then fails with the fix
    assert resolve_cuda_graphs("false", "cuda", False, 1)[0] is False


def test_trainer_on_cpu_logs_that_auto_left_graphs_off(tmp_path, caplog):
    from train_helpers import tiny_config

    from chronicals.train import train

    cfg = tiny_config(tmp_path, train__max_steps=1)
    with caplog.at_level(logging.INFO, logger="chronicals.train"):
        res = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(synthetic_docs(8, seed=1), shuffle=False))
    assert res.status == "completed"
    assert "train.cuda_graphs=auto: off on cpu" in caplog.text


def test_bench_graph_contenders_registered_and_guarded():
    from chronicals.bench.cli import default_contenders

    for name, method in (("chronicals-full-graphs", "full"), ("chronicals-lora-graphs", "lora")):
        assert CONTENDERS[name].method == method
    # the LoRA graph row is in the default table on a GPU, and left out on the CPU (it needs CUDA)
    assert "chronicals-lora-graphs" in default_contenders(get_shape("0.5b"), False, "cuda")
    assert "chronicals-lora-graphs" in default_contenders(get_shape("0.5b"), True, "cuda")
    assert not any(n.endswith("-graphs") for n in default_contenders(get_shape("tiny"), False, "cpu"))
    with pytest.raises(ValueError, match="step='trainer'"):
        chronicals_step(tiny_model(), RunSpec("chronicals-full-graphs", step="bench"), torch.device("cpu"), True)
    with pytest.raises(ValueError, match="CUDA device"):
        chronicals_step(tiny_model(), RunSpec("chronicals-full-graphs", device="cpu"), torch.device("cpu"), True)


def test_bench_graphs_flag_adds_twins():
    from chronicals.bench.cli import parse_args, with_graphs

    assert with_graphs(["chronicals-full", "hf-sdpa", "chronicals-lora"]) == [
        "chronicals-full", "chronicals-full-graphs", "hf-sdpa", "chronicals-lora", "chronicals-lora-graphs"]
    assert with_graphs(["chronicals-lora", "chronicals-lora-graphs"]) == ["chronicals-lora", "chronicals-lora-graphs"]
    assert parse_args(["--graphs"]).graphs and not parse_args([]).graphs


# ---------------------------------------------------------------- capture vs eager (GPU)
def _gpu_model(method: str):
    model = build_chronicals_model(get_shape("tiny"), torch.device("cuda"), "auto", seed=0)  # bf16, head dim 16
    if method == "lora":
        add_chronicals_lora(model, RunSpec("x", lora_r=4, lora_alpha=8))
        with torch.no_grad():  # B = 0 at init would make every A gradient 0: nothing to compare
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    return model


def _micro_batches(layout: str, steps: int, seq: int = 32, per_step: int = 2):
    if layout == "packed":
        loader = SyntheticLoader(synthetic_docs(200, seed=2), batch_size=2, row_len=seq, shuffle=False)
        bs = loader.batches[:per_step * steps]
    else:
        gen = torch.Generator().manual_seed(0)
        bs = [rows_as_packed_batch(torch.randint(0, 512, (2, seq), generator=gen), "rows")
              for _ in range(per_step * steps)]
    return [bs[per_step * i:per_step * (i + 1)] for i in range(steps)]


def _train(model, steps_batches, graphs=None):
    """Optimizer steps over ``steps_batches``; -> (losses, grads of every step)."""
    dev = torch.device("cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    losses, grads = [], []
    for micro in steps_batches:
        loss, _ = accumulate_gradients(model, micro, dev, graphs)
        losses.append(loss.float().item())
        grads.append([p.grad.float().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _assert_same_training(eager, graphed):
    (le, ge), (lg, gg) = eager, graphed
    assert lg == pytest.approx(le, rel=2e-3), (le, lg)
    for step, (a, b) in enumerate(zip(ge, gg)):
        for i, (x, y) in enumerate(zip(a, b)):  # bf16 kernels with atomics: not bitwise, well under 1%
            err = float((x - y).norm()) / max(float(x.norm()), 1e-12)
            assert err < 1e-2, f"step {step} param {i}: relative gradient error {err:.2e}"


def _assert_same_grads(eager_model, graphed_model):
    """Every gradient the eager model holds, within bf16 tolerance in the graphed twin (None where it is None)."""
    for (name, p), q in zip(eager_model.named_parameters(), graphed_model.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            err = float((p.grad.float() - q.grad.float()).norm()) / max(float(p.grad.float().norm()), 1e-12)
            assert err < 1e-2, f"{name}: relative gradient error {err:.2e}"


@cuda
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("per_step", [1, 2])
def test_graphed_step_matches_eager(method, layout, per_step):
    model = _gpu_model(method)
    twin = copy.deepcopy(model)
    batches = _micro_batches(layout, steps=3, per_step=per_step)
    eager = _train(model, batches)
    graphs = GraphedStep(twin, "cuda")
    graphed = _train(twin, batches, graphs)
    _assert_same_training(eager, graphed)
    kinds = graphs.captured()
    assert graphs.eager_fallbacks == 0 and {k for k, _ in kinds} == {graph_key(b) for m in batches for b in m}
    # the step's first micro-batch of the first shape writes the grads afresh (no zeroing, no `grad += g`)
    assert kinds[0] == (graph_key(batches[0][0]), "assign")
    assert len(set(eager[0])) == 3  # three different batches: a replay reading stale inputs would repeat a loss


@cuda
def test_grads_left_from_before_the_step_are_added_to():
    """A step entered with gradients (no zero_grad since the last one) adds to them, as eager backward does:
    the assign graph, which overwrites, must not run then."""
    dev = torch.device("cuda")
    model = _gpu_model("full")
    twin = copy.deepcopy(model)
    graphs = GraphedStep(twin, "cuda")
    micro = _micro_batches("rows", steps=2, per_step=1)
    for m, g in ((model, None), (twin, graphs)):
        accumulate_gradients(m, micro[0], dev, g)
        accumulate_gradients(m, micro[1], dev, g)  # no zero_grad between: d(loss_0) / n_0 + d(loss_1) / n_1
    _assert_same_grads(model, twin)
    assert [kind for _, kind in graphs.captured()] == ["assign", "accumulate"]


@cuda
def test_new_shape_beyond_max_graphs_runs_eagerly_with_a_warning(caplog):
    model = _gpu_model("full")
    twin = copy.deepcopy(model)
    batches = _micro_batches("rows", steps=1, seq=32) + _micro_batches("rows", steps=1, seq=24)
    eager = _train(model, batches)
    graphs = GraphedStep(twin, "cuda", max_graphs=1)
    with caplog.at_level(logging.WARNING, logger="chronicals.train"):
        graphed = _train(twin, batches, graphs)
    _assert_same_training(eager, graphed)
    assert list(graphs.graphs) == [((2, 32, 0), False)] and graphs.eager_fallbacks == 2  # (shape, holds the all-reduce)
    assert "not captured and the max_graphs limit (1 graph) is reached" in caplog.text
    assert "(1 eager micro-batch so far)" in caplog.text and "(2 eager micro-batches so far)" in caplog.text


@cuda
def test_graphed_loss_equals_eager_loss_on_one_batch():
    """The replayed loss is the batch's own (fresh inputs copied in), for the same weights."""
    model = _gpu_model("full")
    graphs = GraphedStep(model, "cuda")
    for micro in _micro_batches("packed", steps=3):
        with torch.no_grad():
            want = sum(float(batch_loss_sum(model, b, torch.device("cuda"))) for b in micro)
            want /= sum(b.num_loss_tokens for b in micro)
        got, _ = accumulate_gradients(model, micro, torch.device("cuda"), graphs)
        model.zero_grad(set_to_none=True)
        assert float(got) == pytest.approx(want, rel=2e-3)


@cuda
@pytest.mark.parametrize("lora", [False, True])
def test_trainer_with_cuda_graphs_trains_like_eager(tmp_path, lora):
    """``train`` end to end (bf16, Triton ops, packed rows, grad_accum 2, clipping, schedule, checkpoint):
    train.cuda_graphs=true logs the same losses and gradient norms as eager training, to bf16 tolerance.
    (The bench's tiny Qwen2 shape: vocab 512 covers the synthetic documents' 61 ids.)"""
    import json

    from train_helpers import assert_graphed_run_like_eager, tiny_config

    from chronicals.train import train

    docs = synthetic_docs(48, seed=2)
    recs = {}
    for graphed in (False, True):
        cfg = tiny_config(tmp_path / str(graphed), model__device="cuda", model__dtype="bfloat16", model__impl="auto",
                          lora__enabled=lora, lora__rank=4, lora__alpha=8, train__max_steps=5, train__grad_accum=2,
                          train__save_final=True, train__cuda_graphs=graphed)
        model = build_chronicals_model(get_shape("tiny"), torch.device("cuda"), "auto", seed=0)  # head dim 16
        res = train(cfg, model=model, train_loader=SyntheticLoader(docs, shuffle=False))
        assert res.status == "completed" and res.step == 5
        lines = (tmp_path / str(graphed) / "run" / "metrics.jsonl").read_text().splitlines()
        recs[graphed] = [r for r in map(json.loads, lines) if r["kind"] == "train"]
    assert_graphed_run_like_eager(recs[False], recs[True], steps=5)


@cuda
def test_a_step_replaying_one_graph_twice_sums_both_losses():
    """A step whose first micro-batch is not of the assign graph's shape replays one accumulating graph for both
    of its micro-batches: the step's loss sums both replays' losses. Had the first been kept as the graph's own
    loss buffer (not a copy), the second replay overwrote it: the loss read twice the second micro-batch's."""
    model = _gpu_model("full")
    twin = copy.deepcopy(model)
    batches = _micro_batches("rows", steps=1, seq=32, per_step=1) + _micro_batches("rows", steps=1, seq=24)
    eager = _train(model, batches)
    graphs = GraphedStep(twin, "cuda")
    _assert_same_training(eager, _train(twin, batches, graphs))
    assert graphs.captured() == [((2, 32, 0), "assign"), ((2, 24, 0), "accumulate")]


@cuda
def test_a_step_without_loss_tokens_gives_zero_loss_and_zero_grads():
    """Every label ignored (a batch of prompts only): the replayed step gives loss 0 and zero gradients, as the
    eager step does (1 / max(n, 1)), instead of dividing by zero."""
    model = _gpu_model("lora")
    twin = copy.deepcopy(model)
    (micro,) = _micro_batches("rows", steps=1, per_step=1)
    for b in micro:
        b.shift_labels.fill_(-100)
        b.num_loss_tokens = 0
    eager = _train(model, [micro])
    graphed = _train(twin, [micro], GraphedStep(twin, "cuda"))
    assert eager[0] == graphed[0] == [0.0]
    assert all(not g.any() for g in eager[1][0] + graphed[1][0])


@cuda
def test_grads_of_an_eager_backward_before_the_first_capture_are_added_to():
    """Gradients made by an eager backward before the graphs' first capture (no zero_grad after it) are added to
    by the graphed step, as eager backward adds: the capture puts them back when it is done. Left as the capture's
    own gradient tensors, the step's gradients were the warm-up's leftovers, the earlier ones lost."""
    dev = torch.device("cuda")
    model = _gpu_model("lora")
    twin = copy.deepcopy(model)
    first, second = _micro_batches("rows", steps=2, per_step=1)
    for m, g in ((model, None), (twin, GraphedStep(twin, "cuda"))):
        accumulate_gradients(m, first, dev, None)  # eager, both
        accumulate_gradients(m, second, dev, g)
    _assert_same_grads(model, twin)


@cuda
def test_max_graphs_zero_runs_every_micro_batch_eagerly():
    """max_graphs=0 captures nothing (not even the assign graph): every micro-batch runs eagerly, counted."""
    model = _gpu_model("full")
    twin = copy.deepcopy(model)
    batches = _micro_batches("rows", steps=2)
    eager = _train(model, batches)
    graphs = GraphedStep(twin, "cuda", max_graphs=0)
    _assert_same_training(eager, _train(twin, batches, graphs))
    assert graphs.captured() == [] and graphs.eager_fallbacks == 4


@cuda
def test_a_packed_batch_of_exactly_the_capacity_in_documents_replays():
    """16 documents fill the smallest capacity (16): the static cu_seqlens buffer holds all 17 boundaries. One
    entry short, this batch was refused by fill_cu_seqlens_ (at the capacity the graph was picked for)."""
    model = _gpu_model("full")
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [[rows_as_packed_batch(torch.randint(0, 512, (16, 32), generator=gen), "packed")] for _ in range(2)]
    assert graph_key(batches[0][0]) == (16, 32, 16)
    eager = _train(model, batches)
    _assert_same_training(eager, _train(twin, batches, GraphedStep(twin, "cuda")))


@cuda
def test_an_unused_trainable_parameter_keeps_no_gradient():
    """A trainable parameter the forward does not use keeps grad None through graphed steps, as eager, also in a
    step that accumulates into the others' gradients (no zero_grad before it, another shape)."""
    dev = torch.device("cuda")
    model = _gpu_model("full")
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(3, device=dev)))
    twin = copy.deepcopy(model)
    first, second = _micro_batches("rows", steps=1, seq=32, per_step=1) + _micro_batches("rows", steps=1, seq=24,
                                                                                        per_step=1)
    graphs = GraphedStep(twin, "cuda")
    for m, g in ((model, None), (twin, graphs)):
        accumulate_gradients(m, first, dev, g)
        accumulate_gradients(m, second, dev, g)  # another shape, grads kept: binds the home grads, zeroing none
    assert model.unused.grad is None and twin.unused.grad is None
    _assert_same_grads(model, twin)


@cuda
def test_capturing_a_model_with_activation_checkpointing_is_refused_with_the_fix():
    """A model set to checkpoint its layers is refused before anything is captured, naming both ways out; the
    checkpointed forward reads the CUDA RNG state, which a capture forbids."""
    model = _gpu_model("full").set_checkpointing(True)
    (micro,) = _micro_batches("rows", steps=1, per_step=1)
    with pytest.raises(RuntimeError, match=r"cuda_graphs with activation checkpointing is not supported: .*"
                                           r"model\.checkpointing=false or train\.cuda_graphs=false"):
        GraphedStep(model, "cuda").accumulate(micro)


@cuda
def test_a_step_with_one_loss_token_gives_the_eager_loss_and_grads():
    """One loss token in the step: its loss and gradients are that token's own (divided by 1), as eager."""
    model = _gpu_model("lora")
    twin = copy.deepcopy(model)
    (micro,) = _micro_batches("rows", steps=1, per_step=1)
    for b in micro:
        b.shift_labels[:, 1:].fill_(-100)
        b.shift_labels[1:].fill_(-100)
        b.num_loss_tokens = 1
    assert sum(int((b.shift_labels != -100).sum()) for b in micro) == 1
    _assert_same_training(_train(model, [micro]), _train(twin, [micro], GraphedStep(twin, "cuda")))
