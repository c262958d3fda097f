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


def _model(tiny_hf_config, family, dtype=torch.float32, device="cpu") -> CausalLM:
    cfg = ModelConfig.from_hf_dict(tiny_hf_config(family))
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
        got = [step.prefill(ids)]
        for t in tokens:
            step.token.fill_(t)
            got.append(step.run())
    assert int(step.pos) == 13 and step.caches[0].filled == 7
    torch.testing.assert_close(torch.stack(got), want, rtol=1e-5, atol=1e-5)


def test_second_prompt_into_a_filled_cache_is_refused(tiny_hf_config):
    model = _model(tiny_hf_config, "llama2")
    step = DecodeStep(model, 6)
    with torch.no_grad(), pytest.raises(ValueError, match="4-token prompt after 0 tokens does not fit its 3 slots"):
        DecodeStep(model, 3).prefill(torch.randint(3, 97, (1, 4)))
    with torch.no_grad():
        step.prefill(torch.randint(3, 97, (1, 4)))
        step.token.fill_(5)
        step.run()
        with pytest.raises(ValueError, match="after the prompt, feed one token at a time"):
            step.model.hidden_states(torch.randint(3, 97, (1, 2)), kv_caches=step.caches)


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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_cuda
@pytest.mark.parametrize("family", ["qwen2", "smollm2"])
@pytest.mark.parametrize("lora", [False, True])
def test_captured_step_decodes_as_eager_on_cuda(tiny_hf_config, family, lora):
    """fp32 on CUDA: the replayed graph's tokens are eager decoding's, and its logits at every step eager's with
    those tokens fed (1e-4: other attention kernels), with and without a LoRA adapter (B random)."""
    model = _model(tiny_hf_config, family, device="cuda")
    if lora:
        apply_lora(model, r=4, alpha=8)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2, generator=torch.Generator("cuda").manual_seed(4))
    ids = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(5)).cuda()
    eager = generate(model, ids, 24, cuda_graph=False)
    graphed = generate(model, ids, 24, cuda_graph=True)
    assert graphed.tolist() == eager.tolist()
    want = _eager_logits(model, ids.view(1, -1), eager.tolist()[:-1])
    step = DecodeStep(model, 30)
    with torch.no_grad():
        got = [step.prefill(ids.view(1, -1)).clone()]
        step.token.fill_(eager[0].item())
        step.capture()
        for t in eager.tolist()[1:]:
            got.append(step.run().clone())
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
        got = [step.prefill(ids).clone()]
        step.token.fill_(tokens[0])
        step.capture()
        for i, t in enumerate(tokens):
            got.append(step.run().clone())
            if i + 1 < len(tokens):
                step.token.fill_(tokens[i + 1])
    err = (torch.stack(got) - want).abs().max().item()
    assert err < 0.05 * want.abs().max().item(), err


def test_qa_one_prompt_goes_through_generate_and_answers_as_in_a_batch(tiny_hf_config, monkeypatch):
    """train.qa.greedy_same_length with one prompt (chat's answers, eval's prompts of a length no other has) runs
    generate, which on CUDA replays the captured step; its tokens are those the prompt gets as a row of a batch,
    eos included where the answer stops."""
    from chronicals.train import qa

    model = _model(tiny_hf_config, "qwen2")
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(8))
    batch = qa.greedy_same_length(model, ids.repeat(2, 1), 10, eos=set())
    assert batch[0] == batch[1]
    eos = {batch[0][3]}
    want = qa.greedy_same_length(model, ids.repeat(2, 1), 10, eos=eos)[0]
    calls = []
    monkeypatch.setattr(generate_mod, "_generate_graphed", lambda *a, **k: calls.append(a))  # not on the CPU
    real = generate_mod.generate
    monkeypatch.setattr(generate_mod, "generate", lambda *a, **k: calls.append("generate") or real(*a, **k))
    assert qa.greedy_same_length(model, ids, 10, eos=eos) == [want]
    assert want[-1] in eos and len(want) < 10 and calls == ["generate"]
