"""models.generate on tiny random models: the arguments it refuses, and where it stops; models.chat; the limits
evaluate takes."""

import importlib
import logging
import re

import numpy as np
import pytest
import torch

from chronicals.bench.shapes import get_shape, model_config
from chronicals.evaluate import evaluate
from chronicals.models import CausalLM, ModelConfig, generate
from chronicals.models.generate import greedy_rows

generate_mod = importlib.import_module("chronicals.models.generate")  # the package's name is the function


def _model(tiny_hf_config, family="qwen3", **overrides) -> CausalLM:
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config(family, **overrides))).init_weights(std=0.5, seed=0).eval()


@pytest.mark.parametrize("shape", [(2, 9), (1, 1, 9), (0,)])
def test_refuses_what_is_not_one_prompt(tiny_hf_config, shape):
    """A (2, 9) batch was read as one 18-token prompt (view(1, -1)): the rows ran into each other and the answer
    continued the second row as if the first came before it; an empty prompt failed with a bare IndexError."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=re.escape(f"one prompt, input_ids (S,) or (1, S) with S >= 1, got shape "
                                                   f"{tuple(shape)}")):
        generate(model, ids, 4)


def _argmax_without_cache(model, ids: torch.Tensor, n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(ids[None])[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor(out[-1:])])
    return out


@pytest.mark.parametrize("prompt_len,expected", [(9, 3), (12, 0), (14, 0)])
def test_stops_at_the_sliding_window(tiny_hf_config, caplog, monkeypatch, prompt_len, expected):
    """Prompt plus answer past a sliding window (Mistral's 4096 of 32768 positions) raised the model's ValueError
    after generating the tokens that fit: chat and eval's QA answers then stopped with an error (exit 3) where a
    prompt past max_position_embeddings gets the tokens that fit and a warning. It now stops at the window."""
    monkeypatch.setattr(generate_mod, "_warned", set())  # the warning is said once per process
    model = _model(tiny_hf_config, "mistral", sliding_window=12)
    ids = torch.randint(3, 97, (prompt_len,), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, 8).tolist()
    assert out == _argmax_without_cache(model, ids, expected)
    assert "sliding_window=12" in caplog.text


def test_no_new_token_is_an_empty_tensor_of_ids(tiny_hf_config, monkeypatch):
    """max_new_tokens=0, and a prompt that fills a sliding window, give an empty int64 tensor as a non-empty answer
    is: an empty float32 one made torch.cat([prompt, answer]) float, no longer token ids."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config, "mistral", sliding_window=12)
    for ids, n in ((torch.tensor([5, 6, 7]), 0), (torch.arange(3, 15), 4)):
        out = generate(model, ids, n)
        assert out.dtype == torch.long and out.shape == (0,)
        assert torch.cat([ids, out]).dtype == torch.long


def test_restores_each_module_mode(tiny_hf_config):
    """A training model with a module left in eval mode (its LoRA dropout off) came back with every module in
    training mode: generate restored model.train(True) over the whole tree."""
    model = _model(tiny_hf_config).train()
    model.model.layers[0].eval()
    before = {name: m.training for name, m in model.named_modules()}
    generate(model, torch.tensor([5, 6, 7]), 2)
    assert {name: m.training for name, m in model.named_modules()} == before


def test_decoding_runs_every_module_in_eval_mode(tiny_hf_config):
    """generate and greedy_rows run every module in eval mode, whatever mode the caller left it in (restoring the
    modes afterwards is not enough: a training model's LoRA dropout would drop during decoding); the training mode
    is back afterwards."""
    model = _model(tiny_hf_config).train()
    seen = []
    for m in (model, model.model.layers[0], model.model.layers[0].mlp, model.lm_head):
        m.register_forward_pre_hook(lambda mod, args: seen.append(mod.training))
    generate(model, torch.tensor([5, 6, 7]), 3)
    greedy_rows(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), 2, set())
    assert seen and not any(seen)
    assert all(m.training for m in model.modules())


def test_the_decoding_choice_is_logged_once_per_process(tiny_hf_config, caplog, monkeypatch):
    """The INFO line saying eager or CUDA-graph decoding is said once per (choice, device), not at every chat turn
    or every batch of eval's answers."""
    monkeypatch.setattr(generate_mod, "_logged", set())
    caplog.set_level("INFO", logger="chronicals.generate")
    model = _model(tiny_hf_config)
    for _ in range(3):
        generate(model, torch.tensor([5, 6]), 2)
    greedy_rows(model, torch.tensor([[5, 6]]), 2, set())
    assert caplog.text.count("generate: eager decoding on cpu") == 1, caplog.text


def test_a_negative_temperature_is_refused_and_a_tensor_eos_stops(tiny_hf_config):
    """temperature -1 decoded greedily without a word (transformers refuses it); eos_token_id as a 0-d tensor
    failed with 'iteration over a 0-d tensor'."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (7,), generator=torch.Generator().manual_seed(1))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=r"temperature=.* must be a finite number >= 0 \(0 = greedy decoding\)"):
            generate(model, ids, 4, temperature=bad)
    first = int(generate(model, ids, 1)[0])
    assert generate(model, ids, 5, eos_token_id=torch.tensor(first)).tolist() == [first]
    assert generate(model, ids, 5, eos_token_id=torch.tensor([first])).tolist() == [first]


def test_by_default_generate_stops_at_the_models_own_eos(tiny_hf_config):
    """Its docstring said "stops at eos", but eos_token_id=None stopped at nothing: the embedded model decoded on
    past <|im_end|> into a made-up next turn (a Python-API walk). None is the model's eos now, as transformers'
    generate; [] decodes max_new_tokens whatever comes."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (7,), generator=torch.Generator().manual_seed(1))
    free = generate(model, ids, 5, eos_token_id=[]).tolist()
    assert len(free) == 5
    model.config.eos_token_id = free[1]
    assert generate(model, ids, 5).tolist() == free[:2]
    assert generate(model, ids, 5, eos_token_id=[]).tolist() == free


def test_takes_a_tokenizer_output_for_one_prompt(tiny_hf_config):
    """apply_chat_template(..., return_tensors="pt") returns a BatchEncoding in transformers 5: generate failed on
    it with AttributeError ('dim'). A padded one (left or right) is refused: its pad ids would be read as prompt
    tokens."""
    from transformers import BatchEncoding

    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(2))
    enc = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert generate(model, enc, 4).tolist() == generate(model, ids, 4).tolist()
    for pad in (slice(None, 2), slice(-2, None)):  # left padding, and right (a mask read by its first column passed)
        mask = torch.ones_like(ids)
        mask[0, pad] = 0
        with pytest.raises(ValueError, match="one unpadded prompt, and this one's attention_mask has zeros"):
            generate(model, BatchEncoding({"input_ids": ids, "attention_mask": mask}), 4)
    with pytest.raises(ValueError, match="one prompt, and this tokenizer output holds 2"):  # ragged: no tensor
        generate(model, BatchEncoding({"input_ids": [[5, 6], [7]]}), 4)
    assert generate(model, BatchEncoding({"input_ids": [ids[0].tolist()]}), 4).tolist() == generate(model, ids, 4).tolist()
    with pytest.raises(ValueError, match=r"without 'input_ids' \(keys: \['ids'\]\)"):
        generate(model, {"ids": ids}, 4)
    # a list of ints (apply_chat_template's default return) is ids; text and other types say what to pass
    assert generate(model, ids[0].tolist(), 4).tolist() == generate(model, ids, 4).tolist()
    with pytest.raises(TypeError, match=r"generate takes token ids, not text; tokenize it first"):
        generate(model, "hello", 4)
    with pytest.raises(TypeError, match=r"got a list it cannot read as ids"):
        generate(model, [[5, 6], [7]], 4)
    with pytest.raises(TypeError, match=r"got ndarray"):
        generate(model, ids.numpy(), 4)
    # ids that are not integers are refused, not read as ids: a list of floats was cut to ints (5.9 -> 5), bools
    # read as 1 and 0
    for bad, dtype in (([5.9, 6.2, 7.7], "torch.float32"), ([True, False], "torch.bool"),
                       (ids.float(), "torch.float32"), (ids.bool(), "torch.bool")):
        with pytest.raises(TypeError, match=rf"integer token ids, got {dtype} ones"):
            generate(model, bad, 4)
    assert generate(model, ids.int(), 4).tolist() == generate(model, ids, 4).tolist()


def test_takes_an_unbatched_tokenizer_output_as_one_prompt(tiny_hf_config):
    """tokenizer(text) without return_tensors gives input_ids as a flat list of ints (and a mask of ones): one
    prompt, decoded as its ids are, not refused as a tokenizer output holding 4 prompts."""
    from transformers import BatchEncoding

    model = _model(tiny_hf_config)
    ids = [11, 5, 42, 7]
    want = generate(model, torch.tensor(ids), 4).tolist()
    assert generate(model, BatchEncoding({"input_ids": ids, "attention_mask": [1] * 4}), 4).tolist() == want
    assert generate(model, {"input_ids": [ids]}, 4).tolist() == want  # the batched form of one row


def test_held_out_loss_and_qa_answers_restore_each_module_mode(tiny_hf_config):
    """train.step.evaluate_loss and models.generate.greedy_rows ran model.train(was_training) afterwards, which also
    switched on a module the caller had left in eval (a LoRA dropout kept off, say)."""
    from chronicals.models.generate import greedy_rows
    from chronicals.train.step import evaluate_loss

    model = _model(tiny_hf_config).train()
    model.model.layers[0].mlp.eval()
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    greedy_rows(model, ids, 2, eos=set())
    assert model.training and not model.model.layers[0].mlp.training

    class Batch:  # what evaluate_loss reads of the loader's PackedBatch
        input_ids, position_ids = ids, torch.arange(6).repeat(2, 1)
        shift_labels, cu_seqlens, max_seqlen, num_loss_tokens = torch.roll(ids, -1, 1), None, None, 12

    evaluate_loss(model, [Batch()], torch.device("cpu"))
    assert model.training and not model.model.layers[0].mlp.training


def test_top_p_samples_only_from_the_nucleus(tiny_hf_config):
    """Nucleus sampling: every drawn first token lies in the smallest set of most likely tokens whose probability
    reaches top_p (computed here from the model's logits in float64); top_p=1 draws outside it; the same seed gives
    the same tokens; a top_p outside (0, 1] is refused."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids.view(1, -1))[0, -1].double()
    probs = torch.softmax(logits / 1.5, dim=-1)
    sorted_p, order = probs.sort(descending=True)
    k = int((sorted_p.cumsum(0) < 0.5).sum()) + 1  # tokens needed to reach 0.5
    nucleus = set(order[:k].tolist())
    assert 1 < k < 20  # a real cut: several tokens in, most out
    g = torch.Generator().manual_seed(0)
    firsts = {int(generate(model, ids, 1, temperature=1.5, top_p=0.5, generator=g)[0]) for _ in range(200)}
    assert firsts <= nucleus and len(firsts) > 1
    g = torch.Generator().manual_seed(0)
    assert {int(generate(model, ids, 1, temperature=1.5, generator=g)[0]) for _ in range(200)} - nucleus
    a = generate(model, ids, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(5))
    b = generate(model, ids, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(5))
    assert a.tolist() == b.tolist()
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"top_p=.* must be in \(0, 1\]"):
            generate(model, ids, 4, temperature=1.0, top_p=bad)



def test_sampling_arguments_of_another_type_and_a_top_p_without_temperature_are_said(tiny_hf_config, caplog):
    """temperature="0.5" or None raised a bare "'<=' not supported" TypeError, and top_p=0.5 without a temperature
    decoded greedily without a word (chronicals chat refuses --top-p without --temperature): a walk of chat."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(3))
    for kw in ({"temperature": "0.5"}, {"temperature": None}, {"top_p": "1"}, {"temperature": True}):
        with pytest.raises(TypeError, match=rf"^generate: {next(iter(kw))}=.* must be a number, got "):
            generate(model, ids, 2, **kw)
    with caplog.at_level(logging.WARNING, logger="chronicals.generate"):
        greedy = generate(model, ids, 3, top_p=0.5)
    assert greedy.tolist() == generate(model, ids, 3).tolist()
    assert any("top_p=0.5 has no effect at temperature=0" in r.getMessage() for r in caplog.records)
    assert generate(model, ids, 2, temperature=np.float32(0.7), generator=torch.Generator().manual_seed(1)).numel()


def _fixed_logits_model(tiny_hf_config, logits):
    """A tiny qwen3 model whose next-token logits are always ``logits`` for the first tokens and -1e4 for the rest
    (lm_head: weight 0, bias the logits)."""
    model = _model(tiny_hf_config)
    v, h = model.lm_head.weight.shape
    head = torch.nn.Linear(h, v, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.fill_(-1e4)
        head.bias[:len(logits)] = torch.tensor(logits)
    model.lm_head = head
    return model


@pytest.fixture
def draws(monkeypatch):
    """The probability vectors generate hands torch.multinomial."""
    seen, real = [], torch.multinomial

    def spy(probs, n, **kw):
        seen.append(probs.detach().clone())
        return real(probs, n, **kw)

    monkeypatch.setattr(torch, "multinomial", spy)
    return seen


@pytest.mark.parametrize("logits, top_p, kept", [([0.0, 0.0], 0.5, 1),
                                                 ([0.0, float(np.log(0.004 / 0.996))], 0.995, 1),
                                                 ([0.0, float(np.log(0.004 / 0.996))], 0.999, 2)],
                         ids=["tie_at_top_p", "top_p_0.995", "top_p_0.999"])
def test_the_nucleus_ends_at_the_token_that_reaches_top_p(tiny_hf_config, draws, logits, top_p, kept):
    """A token stays in the nucleus while the mass of the likelier ones is BELOW top_p: two tied tokens (0.5 each)
    at top_p=0.5 give one token (keeping the second too made it two), and ~0.996 / ~0.004 give one token at
    top_p=0.995 and both at 0.999 (any top_p < 1 cuts, not only ones well below 1)."""
    model = _fixed_logits_model(tiny_hf_config, logits)
    generate(model, torch.tensor([5, 6, 7]), 1, temperature=1.0, top_p=top_p, eos_token_id=[],
             generator=torch.Generator().manual_seed(0))
    (p,) = draws
    assert int((p > 0).sum()) == kept, p[:3]


def test_a_streamer_gets_each_token_as_picked_and_one_end(tiny_hf_config):
    """generate(streamer=...) puts the prompt as a (1, S) tensor, then every new token, as a (1,) tensor, in order,
    then calls end() once, also when no token is asked for: transformers' protocol, so TextStreamer(skip_prompt=
    True) shows exactly the new tokens (it skipped the first new one when the prompt was not put)."""
    from transformers import TextStreamer

    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, (6,), generator=torch.Generator().manual_seed(4))

    class Record:
        def __init__(self):
            self.prompts, self.put_ids, self.ends = [], [], 0

        def put(self, value):
            if value.dim() == 2:
                assert not self.put_ids and value.device.type == "cpu"
                self.prompts.append(value.tolist())
                return
            assert value.shape == (1,)
            self.put_ids.append(int(value[0]))

        def end(self):
            self.ends += 1

    rec = Record()
    out = generate(model, ids, 9, streamer=rec)
    assert rec.prompts == [[ids.tolist()]] and rec.ends == 1
    assert rec.put_ids == out.tolist() == generate(model, ids, 9).tolist()
    rec = Record()
    assert generate(model, ids, 0, streamer=rec).tolist() == [] and rec.put_ids == [] and rec.ends == 1

    class Shown(TextStreamer):  # what it would print: each new token's "text"
        def __init__(self):
            super().__init__(_Digits(), skip_prompt=True)
            self.text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    shown = Shown()
    for _ in range(2):  # end() re-arms skip_prompt for the next call
        out = generate(model, ids, 5, streamer=shown)
        shown.text, printed = "", shown.text
        assert printed == "".join(f"<{t}>" for t in out.tolist()), printed


class _Digits:
    """A tokenizer's decode for TextStreamer: token t is "<t>"."""

    def decode(self, ids, **kw):
        return "".join(f"<{t}>" for t in ids)


@pytest.mark.parametrize("t", [1e-45, 1e-300, 1e-30])
def test_a_temperature_near_zero_samples_the_greedy_tokens(tiny_hf_config, t):
    """logits / 1e-45 was inf, the probabilities NaN: torch.multinomial raised. Near 0 it is greedy (no ties here)."""
    model = _model(tiny_hf_config)
    ids = torch.tensor([1, 5, 9, 2])
    greedy = generate(model, ids, 6)
    assert torch.equal(generate(model, ids, 6, temperature=t, generator=torch.Generator().manual_seed(1)), greedy)


def test_a_temperature_below_the_sharpest_samples_among_the_ties(tiny_hf_config, draws):
    """A temperature above 0 but below SHARPEST_TEMPERATURE samples as SHARPEST_TEMPERATURE does (the module's
    comment): from the tied largest logits, by the generator, not always the argmax's first of them."""
    model = _fixed_logits_model(tiny_hf_config, [0.0, 0.0, 0.0, -1.0])
    got = {int(generate(model, torch.tensor([5, 6, 7]), 1, temperature=1e-40, eos_token_id=[],
                        generator=torch.Generator().manual_seed(s))[0]) for s in range(20)}
    assert got == {0, 1, 2} and len(draws) == 20


def test_a_greedy_sharp_temperature_over_huge_logits_stays_finite(tiny_hf_config, draws):
    """Sampling divides (logits - max) by the temperature: at SHARPEST_TEMPERATURE logits as large as 1e9 (an
    unnormalised head) give the greedy token, where logits / 1e-30 gave inf / inf = NaN probabilities that
    torch.multinomial refuses."""
    model = _fixed_logits_model(tiny_hf_config, [1e9, 0.0, -1e9])
    out = generate(model, torch.tensor([5, 6, 7]), 2, temperature=1e-30, eos_token_id=[],
                   generator=torch.Generator().manual_seed(0))
    assert out.tolist() == [0, 0]
    assert all(bool(torch.isfinite(p).all()) for p in draws)


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1.0])
def test_a_temperature_that_is_not_a_finite_number_is_refused(tiny_hf_config, t):
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        generate(_model(tiny_hf_config), torch.tensor([1, 2]), 2, temperature=t)


@pytest.fixture
def model(tiny_hf_config):
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config("qwen3"))).init_weights(std=0.5, seed=0).eval()


@pytest.mark.parametrize("n", [-1, 2.5, True, "4"])
def test_max_new_tokens_must_be_a_whole_number(model, n):
    """-1 decoded without end (401 tokens past a 128-position context before a streamer stopped it)."""
    ids = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="must be a whole number >= 0"):
        generate(model, ids, n)
    with pytest.raises(ValueError, match="must be a whole number >= 0"):
        greedy_rows(model, ids[None], n, set())


def test_max_new_tokens_may_be_a_numpy_integer(model):
    """A whole number of any integer kind (numpy's, as read from an array or a config) is a max_new_tokens, in
    generate and greedy_rows alike, not only a Python int."""
    ids = torch.tensor([5, 6, 7])
    want = generate(model, ids, 3, eos_token_id=[]).tolist()
    assert generate(model, ids, np.int64(3), eos_token_id=[]).tolist() == want
    assert greedy_rows(model, ids[None], np.int32(3), set()) == [want]


def test_greedy_rows_refuses_prompts_of_no_tokens(model):
    """(B, 0) ids get the ValueError that says what greedy_rows takes, as generate's empty prompt does, not an
    IndexError from deep inside the model."""
    with pytest.raises(ValueError, match=r"ids \(B, S\) with S >= 1, got shape \(2, 0\)"):
        greedy_rows(model, torch.zeros(2, 0, dtype=torch.long), 4, set())


def test_greedy_rows_never_feeds_its_last_token(model):
    """greedy_rows runs the model max_new_tokens times a batch (the prompt, then each new token but the last):
    feeding the last token too cost one more batched forward over the whole cache for nothing (two forwards for
    max_new_tokens=1)."""
    forwards = []
    model.lm_head.register_forward_hook(lambda mod, args, out: forwards.append(out.shape))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    for n in (1, 3):
        forwards.clear()
        assert [len(row) for row in greedy_rows(model, ids, n, set())] == [n, n]
        assert len(forwards) == n, forwards


def test_greedy_rows_with_no_token_to_generate_runs_no_forward(tiny_hf_config, monkeypatch):
    """max_new_tokens=0, or prompts that fill (or pass) a sliding window, give B empty answers without running the
    model: a 14-token prefill on a 12-token window is refused by the model, which ended eval's QA answers."""
    monkeypatch.setattr(generate_mod, "_warned", set())
    model = _model(tiny_hf_config, "mistral", sliding_window=12)
    forwards = []
    model.lm_head.register_forward_hook(lambda mod, args, out: forwards.append(out.shape))
    assert greedy_rows(model, torch.tensor([[5, 6, 7], [8, 9, 10]]), 0, set()) == [[], []]
    ids = torch.randint(3, 97, (2, 14), generator=torch.Generator().manual_seed(0))
    assert greedy_rows(model, ids, 4, set()) == [[], []]
    assert forwards == []


def test_greedy_rows_refuses_cuda_graph_true_on_a_cpu_model(model):
    """greedy_rows(cuda_graph=True) on a CPU model gets generate's ValueError, not silently eager decoding."""
    with pytest.raises(ValueError, match=r"cuda_graph=True\) needs a model on CUDA, and this one is on cpu"):
        greedy_rows(model, torch.tensor([[5, 6, 7]]), 4, set(), cuda_graph=True)


def test_temperature_zero_takes_the_first_tied_token_and_draws_nothing(model):
    """temperature=0 (the default) is greedy decoding: the argmax, the first of tied logits every time, drawing
    nothing from torch's global random generator (sampling at a greedy-sharp temperature picked among the ties at
    random and moved the caller's RNG)."""
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: all tokens tie
    torch.manual_seed(123)
    state = torch.get_rng_state()
    assert generate(model, torch.tensor([5, 6, 7]), 5, eos_token_id=[]).tolist() == [0] * 5
    assert torch.equal(torch.get_rng_state(), state)


def test_eos_ids_of_any_integer_kind(model):
    ids = torch.tensor([5, 6, 7])
    free = generate(model, ids, 6).tolist()
    stop = free[2]
    for eos in (np.int64(stop), [np.int32(stop)], torch.tensor(stop), (stop,)):
        assert generate(model, ids, 6, eos_token_id=eos).tolist() == free[:free.index(stop) + 1]
    assert greedy_rows(model, ids[None], 6, None) == [free]
    assert greedy_rows(model, ids[None], 6, np.int64(stop)) == [free[:free.index(stop) + 1]]
    with pytest.raises(ValueError, match="give a token id or a list of token ids"):
        generate(model, ids, 6, eos_token_id="</s>")


@pytest.mark.parametrize("kw,value", [("qa_limit", -1), ("qa_limit", 1.5), ("max_new_tokens", 0),
                                      ("max_new_tokens", -3)])
def test_evaluate_refuses_a_limit_it_would_misread(kw, value):
    """qa_limit=-1 sliced off the last question; max_new_tokens <= 0 scored every answer 0 without a word."""
    with pytest.raises(ValueError, match=f"evaluate: {kw}={value!r} must be a whole number"):
        evaluate(None, None, None, torch.device("cpu"), **{kw: value})


def _tiny_model():
    return CausalLM(model_config(get_shape("tiny"))).float().init_weights(std=0.5, seed=0).eval()


def test_top_p_keeps_the_token_that_crosses_it():
    """Nucleus = the smallest set of most likely tokens whose mass REACHES top_p: with top_p below the top token's
    probability it is that token alone (sampling is greedy), never an empty set."""
    model = _tiny_model()
    ids = torch.randint(3, 500, (6,), generator=torch.Generator().manual_seed(3))
    greedy = generate(model, ids, 4)
    for seed in range(3):
        got = generate(model, ids, 4, temperature=1.0, top_p=1e-6, generator=torch.Generator().manual_seed(seed))
        assert got.tolist() == greedy.tolist()


class _Tok:
    """A tokenizer stand-in: records the template call, decodes ids as text."""
    chat_template = "{{ messages }}"
    eos_token_id = None

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, **kw):
        self.calls.append((messages, kw))
        return [5, 6, 7] + ([9] if kw.get("add_generation_prompt") else [])  # 9: the opened assistant turn

    def decode(self, ids, skip_special_tokens=False):
        self.skipped_special = skip_special_tokens
        return " ".join(map(str, ids.tolist()))


def test_models_chat_opens_the_assistant_turn():
    from chronicals.models import chat

    tok = _Tok()
    text = chat(_tiny_model(), tok, "hi", max_new_tokens=3)
    (messages, kw), = tok.calls
    assert messages == [{"role": "user", "content": "hi"}] and kw["add_generation_prompt"] is True
    assert len(text.split()) == 3
    assert tok.skipped_special is True  # the reply is shown without its end-of-turn token


def test_chat_stops_at_every_eos_the_model_lists():
    """chat() stopped at the tokenizer's eos alone; a Llama-3.x instruct model lists more ends of a reply in
    config.json and generation_config.json (<|eot_id|>, <|eom_id|>), and each of them ends the answer now."""
    import json

    from chronicals.models import chat, stop_ids

    model, tok = _tiny_model(), _Tok()
    first = int(chat(model, tok, "hi", max_new_tokens=3).split()[0])
    assert stop_ids(model, tok) == {model.config.eos_token_id} != {first}
    model.source_generation_config = json.dumps({"eos_token_id": [first + 1, first]}).encode()
    assert chat(model, tok, "hi", max_new_tokens=3) == str(first)  # the eos ends the ids (a real tokenizer drops it)
    assert stop_ids(model, tok) == {model.config.eos_token_id, first, first + 1}
    model.source_generation_config = b"{not json"  # transformers names that file when it loads it
    model.config.eos_token_id = [first]
    assert chat(model, tok, "hi", max_new_tokens=3) == str(first)
    tok.eos_token_id = 7
    assert stop_ids(model, tok) == {first, 7}
    assert chat(model, tok, "hi", max_new_tokens=3) == str(first)  # the tokenizer's eos adds to the model's


def test_a_generation_config_that_is_not_a_json_object_is_skipped(model):
    """stop_ids reads eos_token_id from a generation_config.json that is a JSON object; one that parses to something
    else (a list) is skipped as unreadable JSON is, not an AttributeError that ends chat and eval."""
    import json

    from chronicals.models import stop_ids

    model.config.eos_token_id = 3
    model.source_generation_config = json.dumps([{"eos_token_id": 9}]).encode()
    assert stop_ids(model, None) == {3}


def test_an_eos_of_id_zero_stops_generate_and_greedy_rows(tiny_hf_config):
    """Token id 0 is an eos like any other (SmolLM2's <|endoftext|> is 0): read as "no eos" (a falsy check), both
    decoders would run on to max_new_tokens past the end of the reply."""
    model = _fixed_logits_model(tiny_hf_config, [1.0, 0.0])  # token 0 always
    ids = torch.tensor([5, 6, 7])
    assert generate(model, ids, 4, eos_token_id=0).tolist() == [0]
    assert greedy_rows(model, torch.stack([ids, ids + 1]), 4, 0) == [[0], [0]]
    assert greedy_rows(model, ids[None], 4, [0]) == [[0]]
