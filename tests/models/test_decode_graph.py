"""models.decode_graph: the static KV cache and the decode step that generate replays as a CUDA graph.

On the CPU the step runs eagerly on the same cache (``_generate_graphed(..., capture=False)``), so the cache logic
(prompt slots, writing at the device-side position, the mask over unwritten slots) is checked against eager
decoding with the growing cache; on CUDA the captured step is checked against eager decoding too."""

import importlib

import pytest
import torch

from chronicals.lora import apply_lora
from chronicals.models import CausalLM, ModelConfig, generate
from chronicals.models.decode_graph import DecodeStep
from chronicals.models.decoder import KVCache

generate_mod = importlib.import_module("chronicals.models.generate")
FAMILIES = ["llama2", "qwen2", "qwen3", "smollm2", "llama3"]


def _model(tiny_hf_config, family, dtype=torch.float32, device="cpu", **over) -> CausalLM:
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family, **over))
    return CausalLM(cfg).init_weights(std=0.5, seed=0).to(device=device, dtype=dtype).eval()


def _eager_logits(model, ids, tokens):
    """fp32 logits (T + 1, V): the prompt's last token, then each of ``tokens`` fed one at a time (growing cache)."""
    caches = [KVCache() for _ in model.model.layers]
    out, step = [], ids
    with torch.no_grad():
        for t in [None, *tokens]:
            if t is not None:
                step = torch.tensor([[t]], device=ids.device)
            out.append(model.lm_head(model.hidden_states(step, kv_caches=caches)[:, -1]).float()[0])
    return torch.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_cache_step_gives_the_growing_caches_logits(tiny_hf_config, family):
    """Prompt of 7, then 6 tokens one at a time into 20 slots (7 never written): every step's logits as eager
    decoding's (fp32, 1e-5). A slot past pos leaking into attention, or a write at the wrong slot, moves them."""
    model = _model(tiny_hf_config, family)
    g = torch.Generator().manual_seed(1)
    ids, tokens = torch.randint(3, 97, (1, 7), generator=g), torch.randint(3, 97, (6,), generator=g).tolist()
    want = _eager_logits(model, ids, tokens)
    step = DecodeStep(model, 20)
    with torch.no_grad():
        got = [step.prefill(ids)[0]]
        for t in tokens:
            step.token.fill_(t)
            got.append(step.run()[0])
    assert int(step.pos) == 13 and step.caches[0].filled == 7
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_the_static_cache_refuses_what_does_not_fit_its_slots_or_rows(tiny_hf_config):
    """The static cache refuses what does not fit its slots or rows with a ValueError naming the shapes: a prompt
    longer than its slots (one of exactly its slots fits), then two tokens for a row, or a token for each of 2 rows
    into a 1-row cache (without that check: a raw index_copy_ error from inside the step)."""
    model = _model(tiny_hf_config, "llama2")
    step = DecodeStep(model, 6)
    with torch.no_grad(), pytest.raises(ValueError, match="4-token prompt after 0 tokens does not fit its 3 slots"):
        DecodeStep(model, 3).prefill(torch.randint(3, 97, (1, 4)))
    with torch.no_grad():
        assert DecodeStep(model, 4).prefill(torch.randint(3, 97, (1, 4))).shape[0] == 1
        step.prefill(torch.randint(3, 97, (1, 4)))
        step.token.fill_(5)
        step.run()
        with pytest.raises(ValueError, match=r"feed one token a row to its 1 row, .* got \(1, 2, "):
            step.model.hidden_states(torch.randint(3, 97, (1, 2)), kv_caches=step.caches)
        with pytest.raises(ValueError, match=r"feed one token a row to its 1 row, .* got \(2, 1, "):
            step.model.hidden_states(torch.randint(3, 97, (2, 1)), kv_caches=step.caches)
        with pytest.raises(ValueError, match="DecodeStep for 2 rows got 1 prompt$"):
            DecodeStep(model, 6, batch=2).prefill(torch.randint(3, 97, (1, 4)))


def test_a_decode_step_past_the_sliding_window_is_refused_on_the_host(tiny_hf_config):
    """The cache's `length` is the prompt's token count, which the decoder's host-side length check adds to the
    step's one token: after an 8-token prompt, a Mistral model with sliding_window=8 refuses the decode step (9
    tokens need sliding-window attention, which chronicals does not implement) instead of computing full attention
    over 9 slots, a silently different output."""
    model = _model(tiny_hf_config, "mistral", sliding_window=8)
    step = DecodeStep(model, 9)
    with torch.no_grad():
        step.prefill(torch.randint(3, 97, (1, 8)))
        assert step.caches[0].length == 8
        step.token.fill_(5)
        with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than this mistral model's "
                                             "sliding_window=8"):
            step.run()


def test_the_static_cache_takes_the_models_dtype(tiny_hf_config):
    """A bf16 model gets bf16 cache buffers, and a decode step runs on the CPU (an fp32 cache doubled the memory
    and index_copy_ refused the bf16 keys). The logits of prefill() and run() are fp32 (B, V) all the same, as
    generate's sampling and the eager loop it must match use (without .float(): bf16 logits)."""
    model = _model(tiny_hf_config, "llama2", dtype=torch.bfloat16)
    step = DecodeStep(model, 8)
    assert step.caches[0].k.dtype == step.caches[0].v.dtype == torch.bfloat16
    with torch.no_grad():
        first = step.prefill(torch.randint(3, 97, (1, 3)))
        step.token.fill_(5)
        second = step.run()
    for logits in (first, second):
        assert logits.dtype == torch.float32 and logits.shape == (1, model.config.vocab_size), logits.dtype


def test_growing_cache_refuses_two_new_tokens_after_the_prompt():
    """KVCache's decode step runs SDPA without a causal mask (right for one query token): two new tokens at once
    would let the first attend to the second, so they are refused (without the check: a silently wrong output)."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache()
    q, k, v = (torch.randn(1, 3, 2, 4, generator=g) for _ in range(3))
    assert cache.attend(q, k, v).shape == (1, 3, 2, 4)  # the prompt: causal over itself
    q2, k2, v2 = (torch.randn(1, 2, 2, 4, generator=g) for _ in range(3))
    with pytest.raises(ValueError, match="feed one token at a time"):
        cache.attend(q2, k2, v2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graphed_loop_picks_the_eager_loops_tokens(tiny_hf_config, temperature):
    """_generate_graphed (its step run eagerly here) against generate's eager loop: same tokens, greedy and sampled
    from the same generator seed, and the same stop at eos."""
    model = _model(tiny_hf_config, "qwen2")
    ids = torch.randint(3, 97, (5,), generator=torch.Generator().manual_seed(2))
    want = generate(model, ids, 12, temperature=temperature, generator=torch.Generator().manual_seed(3))

    def picker():  # a fresh generator per run, seeded as generate's
        g = torch.Generator().manual_seed(3)

        def pick(logits):
            if temperature > 0:
                return int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g))
            return int(logits.argmax())
        return pick

    with torch.no_grad():
        got = generate_mod._generate_graphed(model, ids.view(1, -1), 12, set(), picker(), capture=False)
        assert got.tolist() == want.tolist()
        eos = want[4].item()
        stop = generate_mod._generate_graphed(model, ids.view(1, -1), 12, {eos}, picker(), capture=False)
    assert stop.tolist() == want.tolist()[:want.tolist().index(eos) + 1]


def test_cuda_graph_true_on_cpu_says_what_to_pass(tiny_hf_config):
    model = _model(tiny_hf_config, "llama2")
    with pytest.raises(ValueError, match=r"cuda_graph=True\) needs a model on CUDA, and this one is on cpu"):
        generate(model, torch.tensor([5, 6]), 4, cuda_graph=True)


def test_auto_decodes_eagerly_on_cpu_and_says_so(tiny_hf_config, caplog, monkeypatch):
    monkeypatch.setattr(generate_mod, "_logged", set())
    caplog.set_level("INFO", logger="chronicals.generate")
    generate(_model(tiny_hf_config, "llama2"), torch.tensor([5, 6]), 20)
    assert "generate: eager decoding on cpu" in caplog.text
    assert generate_mod.decode_with_graph(None, torch.device("cuda"), 16)
    assert not generate_mod.decode_with_graph(None, torch.device("cuda"), 15)


def _random_lora(model) -> None:
    """A LoRA adapter with B random (zero B leaves the branch invisible)."""
    apply_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2, generator=torch.Generator(p.device).manual_seed(4))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "smollm2"])
@pytest.mark.parametrize("lora", [False, True])
def test_captured_step_decodes_as_eager_on_cuda(tiny_hf_config, family, lora):
    """fp32 on CUDA: the replayed graph's tokens are eager decoding's, and its logits at every step eager's with
    those tokens fed (1e-4: other attention kernels), with and without a LoRA adapter (B random)."""
    model = _model(tiny_hf_config, family, device="cuda")
    if lora:
        _random_lora(model)
    ids = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(5)).cuda()
    eager = generate(model, ids, 24, cuda_graph=False)
    graphed = generate(model, ids, 24, cuda_graph=True)
    assert graphed.tolist() == eager.tolist()
    want = _eager_logits(model, ids.view(1, -1), eager.tolist()[:-1])
    step = DecodeStep(model, 30)
    with torch.no_grad():
        got = [step.prefill(ids.view(1, -1))[0].clone()]
        step.token.fill_(eager[0].item())
        step.capture()
        for t in eager.tolist()[1:]:
            got.append(step.run()[0].clone())
            step.token.fill_(t)
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_captured_step_in_bf16_stays_near_eager(tiny_hf_config):
    """bf16: the replayed step's logits within bf16 rounding of eager decoding's for the same tokens."""
    model = _model(tiny_hf_config, "smollm2", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(6)).cuda()
    tokens = torch.randint(3, 97, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    want = _eager_logits(model, ids, tokens)
    step = DecodeStep(model, 27)
    with torch.no_grad():
        got = [step.prefill(ids)[0].clone()]
        step.token.fill_(tokens[0])
        step.capture()
        for i, t in enumerate(tokens):
            got.append(step.run()[0].clone())
            if i + 1 < len(tokens):
                step.token.fill_(tokens[i + 1])
    err = (torch.stack(got) - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err


def _rows_with_stops(model, ids, n):
    """Greedy rows of ``ids`` (B, S) decoded eagerly, and an eos set that stops row 0 at its 3rd token and row 2 at
    its 6th (when those tokens do not come earlier in the rows): rows that stop at different steps."""
    free = generate_mod.greedy_rows(model, ids, n, set(), cuda_graph=False)
    return {free[0][2], free[2][5]}


@pytest.mark.parametrize("family", ["qwen2", "smollm2"])
def test_batched_static_step_answers_each_row_as_alone(tiny_hf_config, family):
    """greedy_rows on the static B-row cache (its step run eagerly here) against the growing cache and against
    each prompt decoded alone by generate: same tokens per row, rows stopping at their own eos."""
    model = _model(tiny_hf_config, family)
    ids = torch.randint(3, 97, (3, 5), generator=torch.Generator().manual_seed(9))
    eos = _rows_with_stops(model, ids, 12)
    grown = generate_mod.greedy_rows(model, ids, 12, eos, cuda_graph=False)
    with torch.no_grad():
        static = generate_mod._greedy_rows_static(model, ids, 12, eos, capture=False)
    alone = [generate(model, row, 12, eos_token_id=sorted(eos), cuda_graph=False).tolist() for row in ids]
    assert static == grown == alone
    assert len({len(r) for r in static}) > 1, static  # the rows stopped at different steps
    assert generate_mod.greedy_rows(model, ids, 0, eos) == [[], [], []]
    with pytest.raises(ValueError, match=r"ids \(B, S\) with S >= 1, got shape \(5,\)"):
        generate_mod.greedy_rows(model, ids[0], 4, eos)


def test_qa_answers_go_through_greedy_rows_in_batches_of_at_most_qa_batch_rows(tiny_hf_config, monkeypatch):
    """train.qa.answer_many decodes prompts of one length together, QA_BATCH_ROWS at a time (a KV cache per batch),
    each batch through generate.greedy_rows (on CUDA: the captured B-row step)."""
    from chronicals.train import qa

    calls = []
    monkeypatch.setattr(qa, "QA_BATCH_ROWS", 2)
    monkeypatch.setattr(qa, "greedy_rows", lambda model, ids, n, eos: calls.append(ids.shape) or [[7]] * len(ids))

    class Tok:
        eos_token_id = 1

        def decode(self, toks, skip_special_tokens):
            return f"tok{toks[0]}"
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): torch.full((len(q),), 5))
    out = qa.answer_many(_model(tiny_hf_config, "qwen2"), Tok(), ["aaa", "bbb", "cc", "ddd", "eee"], "", 4)
    assert out == ["tok7"] * 5
    assert sorted(tuple(c) for c in calls) == [(1, 2), (2, 3), (2, 3)]  # 4 prompts of 3 tokens: two batches


@needs_cuda
@pytest.mark.parametrize("lora", [False, True])
def test_captured_batched_step_decodes_as_eager_on_cuda(tiny_hf_config, lora):
    """fp32 on CUDA: greedy_rows through the captured 3-row step gives eager decoding's tokens per row, rows
    stopping at their own eos, with and without a LoRA adapter (B random)."""
    model = _model(tiny_hf_config, "smollm2", device="cuda")
    if lora:
        _random_lora(model)
    ids = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(10)).cuda()
    eos = _rows_with_stops(model, ids, 24)
    eager = generate_mod.greedy_rows(model, ids, 24, eos, cuda_graph=False)
    graphed = generate_mod.greedy_rows(model, ids, 24, eos, cuda_graph=True)
    assert graphed == eager and len({len(r) for r in eager}) > 1, eager
