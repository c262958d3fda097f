"""Held-out evaluation. evaluate_loss, the held-out loss the trainer logs (eval.every, before / after): the mean over
loss tokens of every batch, computed in eval mode, with the model's mode given back.

The trainer tests see it only through "the loss after is lower than before", which a rescaled loss, dropout left
on during evaluation, or dropout switched off for the rest of training all pass.

Also: evaluate() refuses a negative qa_limit, max_new_tokens below 1 and a bool limit, naming the argument, before
any data is read, and takes system_prompt='' as no system message, not as unset; the held-out loaders of train
(build_loaders) and eval (heldout_loader) fail with one clear error naming which data (or skip under
data.on_error=skip), never a traceback or advice that does not fit the caller, read a QA file as chat whatever
data.format, and name its records, not its temporary chat copy, in warnings; and when the trainer evaluates: the last
step once under eval.every, the closing evaluation a finished run resumed without it lacks, and each eval record's
loss-token count. And step.py's other pieces with no GPU: accumulate_gradients' refusal of another model's graphs
and clip_grad_norm's returned norm and fp32 clip coefficient.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from chronicals.config import DataSection, from_dict
from chronicals.evaluate import evaluate
from chronicals.lora import apply_lora
from chronicals.train import train
from chronicals.train.setup import data_files
from chronicals.train.step import accumulate_gradients, batch_loss_sum, clip_grad_norm, evaluate_loss

from train_helpers import SyntheticLoader, synthetic_docs, tiny_config, tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def batches():
    """Three one-row batches with unequal loss-token counts (equal counts would hide a mean of means)."""
    b = SyntheticLoader(synthetic_docs(30, seed=3), batch_size=1, row_len=29, shuffle=False).batches[:3]
    assert len({x.num_loss_tokens for x in b}) > 1
    return b


@pytest.fixture
def lora_model():
    """A float64 model with LoRA dropout 0.5 and nonzero B, so dropout changes the loss whenever it is on."""
    model = tiny_model(dtype=torch.float64)
    apply_lora(model, r=4, alpha=8, dropout=0.5, target_modules=("q_proj", "v_proj"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def test_held_out_loss_is_the_token_weighted_mean_without_dropout(lora_model, batches):
    """Sum of the batches' loss sums over their total loss tokens, with dropout off, and the count returned is
    loss tokens (not the mean of per-batch means and a batch count, nor a loss with dropout on)."""
    lora_model.eval()
    with torch.no_grad():
        want = sum(batch_loss_sum(lora_model, b, CPU).item() for b in batches) / sum(b.num_loss_tokens for b in batches)
    lora_model.train()
    loss, n = evaluate_loss(lora_model, batches, CPU)
    assert n == sum(b.num_loss_tokens for b in batches)
    assert loss == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("training", [True, False])
def test_evaluation_gives_the_model_its_mode_back(lora_model, batches, training):
    """A model evaluated during training (eval.every) trains on in training mode, with its LoRA dropout; one
    evaluated in eval mode stays there."""
    lora_model.train(training)
    evaluate_loss(lora_model, batches[:1], CPU)
    assert all(m.training == training for m in lora_model.modules())


def test_a_stop_already_requested_scores_no_batch(batches):
    """``stop`` is asked before the first batch too: a stop requested before the pass abandons it at once,
    (None, 0), with no forward run (asked only after a batch, one batch, a whole round under DP, was scored)."""
    model = tiny_model()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    assert evaluate_loss(model, batches[:2], CPU, stop=lambda: True) == (None, 0)
    assert not calls


def test_a_stop_requested_midway_ends_the_pass_there(batches):
    """A stop asked for before the second batch ends the pass with the first batch's count, though ``stop`` would
    say False again afterwards."""
    answers = iter([False, True, False])
    assert evaluate_loss(tiny_model(), batches, CPU, stop=lambda: next(answers)) == (None, batches[0].num_loss_tokens)


def test_held_out_batches_without_loss_tokens_give_zero_not_nan(batches):
    """A held-out set with no loss token gives (0.0, 0), not 0/0 = NaN, which the trainer's interval evaluation
    reads as a divergence and stops the run on (the zero-token case was tested only for training steps)."""
    b = replace(batches[0], shift_labels=torch.full_like(batches[0].shift_labels, -100), num_loss_tokens=0)
    loss, n = evaluate_loss(tiny_model(), [b, b], CPU)
    assert n == 0 and loss == 0.0


@pytest.mark.parametrize("kw, says", [({"qa_limit": -1}, "qa_limit=-1"), ({"max_new_tokens": 0}, "max_new_tokens=0"),
                                      ({"qa_limit": True}, "qa_limit=True"), ({"qa_limit": 1.5}, "qa_limit=1.5"),
                                      ({"max_new_tokens": 8.0}, "max_new_tokens=8.0")])
def test_bad_limits_are_refused_naming_the_argument(kw, says, tmp_path):
    data = DataSection(path=str(tmp_path / "never-read.jsonl"))
    with pytest.raises(ValueError, match=f"evaluate: {says} must be a whole number"):
        evaluate(None, None, data, torch.device("cpu"), **kw)


def test_max_seq_len_equal_to_the_models_context_is_not_warned_of(monkeypatch, caplog):
    """evaluate: a max_seq_len equal to the model's max_position_embeddings uses only trained positions and is not
    warned of; one past it is ("positions past 64 were not trained" was said for rows of exactly 64). The data is
    never read: the loader is stubbed to stop right after the check."""
    def stop(*a, **k):
        raise RuntimeError("stop here")

    monkeypatch.setattr("chronicals.evaluate.heldout_loader", stop)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    for length in (64, 65):
        with caplog.at_level(logging.WARNING, logger="chronicals.evaluate"), pytest.raises(RuntimeError, match="stop"):
            evaluate(model, None, DataSection(path="x.jsonl", max_seq_len=length), CPU)
    said = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("max_seq_len=65 is longer than"), said


@pytest.fixture(scope="module")
def tokenizer():
    from smollm2_tokenizer import smollm2_tokenizer

    return smollm2_tokenizer()


def _cfg(tmp_path, *overrides):
    from chronicals.config import load_config

    given = {o.split("=", 1)[0] for o in overrides}  # a key given twice is refused: an override replaces a default
    defaults = ["data.max_seq_len=16", "data.cache_dir=none", "eval.qa=false", f"train.out_dir={tmp_path / 'run'}"]
    return load_config(None, [d for d in defaults if d.split("=", 1)[0] not in given] + list(overrides))


def test_the_trainers_data_errors_name_config_keys_not_load_dataset(tokenizer, tmp_path):
    """Was "(raise data.max_seq_len or set data.on_long=truncate; in load_dataset: max_seq_len,
    overlong='truncate')" and "(data.on_error=skip, or load_dataset(on_error='skip'), drops ...)"."""
    from chronicals.data import DataError
    from chronicals.train.setup import build_loaders

    long = tmp_path / "long.jsonl"
    long.write_text('{"text": "' + "word " * 40 + '"}\n')
    with pytest.raises(DataError, match=r"\(raise data\.max_seq_len or set data\.on_long=truncate\)") as e:
        build_loaders(_cfg(tmp_path, f"data.path={long}", "data.on_long=drop", "data.eval_path="), tokenizer,
                      tmp_path / "run")
    assert "load_dataset" not in str(e.value)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r":2: invalid JSON .*\(data\.on_error=skip drops bad records") as e:
        build_loaders(_cfg(tmp_path, f"data.path={long}", f"data.eval_path={bad}"), tokenizer, tmp_path / "run")
    assert "load_dataset" not in str(e.value)


def test_the_training_data_line_says_how_the_rows_were_packed_in_words(tokenizer, tmp_path, caplog):
    """build_loaders logs the packing in words, its counts from the loader's stats: it logged the stats dict
    (efficiency 0.2800071022727273 in the demo's log)."""
    from chronicals.train.setup import build_loaders

    train = tmp_path / "train.jsonl"
    train.write_text("".join('{"text": "%s"}\n' % ("word " * n) for n in (3, 5, 9, 2, 7)))
    with caplog.at_level(logging.INFO, logger="chronicals"):
        loader, _, _ = build_loaders(_cfg(tmp_path, f"data.path={train}", "data.eval_path=", "data.batch_size=2"),
                                     tokenizer, tmp_path / "run")
    st = loader.stats
    assert st["rows"] > 1 and 0 < st["loss_tokens"] < st["tokens"] < st["slots"]  # every count its own number
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("training data: "))
    assert line == (f"training data: 5 examples -> {len(loader)} batches per epoch; packed into {st['rows']} rows: "
                    f"{st['tokens']} tokens in {st['slots']} slots ({st['tokens'] / st['slots']:.1%} full), "
                    f"{st['loss_tokens']} with loss (efficiency {st['loss_tokens'] / st['slots']:.1%})"), line


def test_a_bad_held_out_record_is_named_with_the_data_it_is_in(tokenizer, tmp_path):
    """A bad record of a held-out file fails as "the held-out set: FILE:LINE: ..." in train's loaders and "the data to
    score: FILE:LINE: ..." in chronicals eval's; without the prefix the record error named only a file and line."""
    from chronicals.data import DataError
    from chronicals.evaluate import heldout_loader
    from chronicals.train.setup import build_loaders

    train = tmp_path / "train.jsonl"
    train.write_text('{"text": "hello there"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": 5}\n')
    with pytest.raises(DataError) as e:
        build_loaders(_cfg(tmp_path, f"data.path={train}", f"data.eval_path={bad}"), tokenizer, tmp_path / "run")
    assert str(e.value).startswith(f"the held-out set: {bad}:2: field 'text' is an int"), str(e.value)
    with pytest.raises(DataError) as e:
        heldout_loader(DataSection(path=str(bad), max_seq_len=16, cache_dir="none"), tokenizer, tmp_path / "work")
    assert str(e.value).startswith(f"the data to score: {bad}:2: field 'text' is an int"), str(e.value)


def _train_and_qa(tmp_path, qa_lines: str):
    """A one-record text training file and a question/answer held-out file of ``qa_lines``: their paths."""
    train, qa = tmp_path / "train.jsonl", tmp_path / "qa.jsonl"
    train.write_text('{"text": "hello there"}\n')
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n' + qa_lines)
    return train, qa


def test_a_qa_heldout_file_with_a_broken_line_trains_under_on_error_skip(tokenizer, tmp_path):
    from chronicals.train.setup import build_loaders

    train, qa = _train_and_qa(tmp_path, "{broken\n")
    cfg = _cfg(tmp_path, f"data.path={train}", f"data.eval_path={qa}", "data.on_error=skip", "data.max_seq_len=64")
    _, eval_loader, heldout = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert heldout == [{"question": "Capital of France?", "answer": "Paris", "keywords": ["Paris"]}]
    assert len(eval_loader.dataset) == 1


def test_a_qa_heldout_file_is_read_as_chat_under_data_format_text(tokenizer, tmp_path):
    """A question/answer held-out file is read as chat (its rewritten copy's format) whatever data.format says for the
    training data: under data.format=text, train's loader (build_loaders) and eval's (heldout_loader) each score its
    one example with the loss on the answer only. Read with data.format, the chat copy failed as a text record."""
    from chronicals.evaluate import heldout_loader
    from chronicals.train.setup import build_loaders

    train, qa = _train_and_qa(tmp_path, "")
    cfg = _cfg(tmp_path, f"data.path={train}", f"data.eval_path={qa}", "data.format=text", "data.max_seq_len=64")
    _, eval_loader, heldout = build_loaders(cfg, tokenizer, tmp_path / "run")
    assert heldout is not None and len(eval_loader.dataset) == 1
    n = eval_loader.dataset.stats.loss_tokens
    assert 0 < n <= 4  # the answer (and its end of turn), not the whole rendered prompt
    loader, records = heldout_loader(DataSection(path=str(qa), format="text", max_seq_len=64, cache_dir="none"),
                                     tokenizer, tmp_path / "work")
    assert records is not None and loader.dataset.stats.loss_tokens == n


def test_evals_qa_loader_honors_on_error_skip(tokenizer, tmp_path):
    from chronicals.config import DataSection
    from chronicals.evaluate import heldout_loader

    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n{broken\n')
    loader, records = heldout_loader(DataSection(path=str(qa), on_error="skip", cache_dir="none"), tokenizer,
                                     tmp_path / "work")
    assert [r["answer"] for r in records] == ["Paris"] and len(loader.dataset) == 1


def test_evals_qa_loader_counts_the_bad_records_of_the_file_and_of_its_chat_copy(tokenizer, tmp_path):
    import copy

    from chronicals.config import DataSection
    from chronicals.evaluate import heldout_loader

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m['content'] == 'Q?' %}{{ raise_exception('no') }}{% endif %}"
                         "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n{"question": "Q?", "answer": "Yes"}\n'
                  '{broken\n')
    loader, records = heldout_loader(DataSection(path=str(qa), on_error="skip", max_seq_len=64, cache_dir="none"),
                                     tok, tmp_path / "work")
    stats = loader.dataset.stats
    assert len(records) == 2 and len(loader.dataset) == 1
    assert (stats.records, stats.skipped_errors) == (3, 2), stats


def test_a_qa_file_on_a_tokenizer_without_a_template_is_not_told_to_set_format_text(tokenizer, tmp_path):
    """Was "... to train on plain text instead, set data.format=text": QA records are chat whatever the format."""
    import copy

    from chronicals.config import DataSection
    from chronicals.evaluate import heldout_loader

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    with pytest.raises(ValueError, match=r"no chat template.*; question/answer records are read as chat whatever "
                                         r"data\.format; to score this model without a template, give text") as e:
        heldout_loader(DataSection(path=str(qa), format="text", cache_dir="none"), plain, tmp_path / "work")
    assert "data.format=text" not in str(e.value)


def test_a_qa_files_data_warnings_name_records_not_the_temporary_copy(tokenizer, tmp_path, caplog):
    """eval of a QA file: a data warning about its chat copy (deleted before the warning is read) names "record N" of
    "the QA records of FILE, rewritten as chat", never the copy's path; here the first reply without an end-of-turn
    token, under a chat template that closes no reply. The line number was left bare ("first: 1"). The loader's stats
    (an EvalResult's) say it the same way."""
    import copy

    from chronicals.evaluate import heldout_loader

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "{% if m['role'] != 'assistant' %}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n{"question": "Q?", "answer": "Yes"}\n')
    work = tmp_path / "work"
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        loader, _ = heldout_loader(DataSection(path=str(qa), max_seq_len=64, cache_dir="none"), tok, work)
    assert "train no end-of-turn token (first: record 1)" in caplog.text, caplog.text
    assert str(work) not in caplog.text and f"the QA records of {qa}, rewritten as chat" in caplog.text
    assert loader.dataset.stats.first_unclosed == "record 1"  # EvalResult.stats: the same words, not the copy's path


def test_an_empty_system_prompt_given_to_evaluate_is_used(tokenizer, tmp_path):
    """evaluate(system_prompt='') asks the QA prompts with no system message (the chat template's default) even when
    data.system_prompt is another text (chronicals eval --system-prompt ''); '' was taken as unset, and the
    data's "Be brief." was used."""
    import transformers

    from chronicals.models import CausalLM, ModelConfig

    hf = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"question": "Capital of France?", "answer": "Paris"}\n')
    opts = dict(path=str(qa), max_seq_len=128, cache_dir="none")
    given = evaluate(model, tokenizer, DataSection(system_prompt="Be brief.", **opts), CPU, system_prompt="",
                     max_new_tokens=1)
    plain = evaluate(model, tokenizer, DataSection(**opts), CPU, max_new_tokens=1)  # the default: none
    told = evaluate(model, tokenizer, DataSection(system_prompt="Be brief.", **opts), CPU, max_new_tokens=1)
    assert given.system_prompt == "" == plain.system_prompt and told.system_prompt == "Be brief."
    assert given.loss == plain.loss != told.loss and given.as_dict()["qa"]["system_prompt"] == ""


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_of_a_finished_run_without_its_closing_eval_runs_it(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=2)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    first = train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=ev())
    path = tmp_path / "run" / "metrics.jsonl"
    # as a signal after the last step's checkpoint leaves it: every step trained, no "after" evaluation
    kept = [r for r in _records(tmp_path / "run") if r.get("tag") != "after"]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    again = tiny_config(tmp_path, train__max_steps=2, train__resume="auto")
    res = train(again, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=ev())
    assert res.eval_loss_after == pytest.approx(first.eval_loss_after)
    assert [r["step"] for r in _records(tmp_path / "run") if r.get("tag") == "after"] == [2]


def test_interval_eval_skips_the_last_step(tmp_path, docs):
    cfg = tiny_config(tmp_path, train__max_steps=4, eval__every=2)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs),
          eval_loader=SyntheticLoader(docs[:4], shuffle=False))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r.get("tag")) for r in recs if r.get("kind") == "eval"]
    assert [s for s, _ in evals].count(4) == 1, evals
    assert (2, "interval") in evals and (4, "after") in evals


def test_eval_records_count_every_held_out_loss_token(tmp_path, docs):
    """Each eval record ("before", "interval", "after") has eval_tokens equal to the held-out set's whole loss-token
    count (an off-by-one there went unseen), and the "before" eval_loss is evaluate_loss of the untrained model."""
    held = SyntheticLoader(docs[:6], shuffle=False)
    total = sum(int(b.num_loss_tokens) for b in held.batches)
    want_before, n = evaluate_loss(tiny_model(), held, CPU)
    assert n == total
    train(tiny_config(tmp_path, train__max_steps=2, eval__every=1), model=tiny_model(),
          train_loader=SyntheticLoader(docs[:16]), eval_loader=held)
    evals = [r for r in _records(tmp_path / "run") if r["kind"] == "eval"]
    assert [(r["step"], r["tag"]) for r in evals] == [(0, "before"), (1, "interval"), (2, "after")]
    assert all(r["eval_tokens"] == total for r in evals)
    assert evals[0]["eval_loss"] == pytest.approx(want_before, rel=1e-6)


def test_a_non_finite_interval_evaluation_stops_the_run_at_that_step(tmp_path, docs):
    """An interval evaluation (eval.every) whose held-out loss is NaN stops the run there (TrainingDiverged naming the
    step) instead of training on to the end on weights that give a NaN held-out loss."""
    from chronicals.train import TrainingDiverged

    model = tiny_model()
    # every held-out pass (the model in eval mode) gives NaN; training (train mode) stays finite
    model.model.norm.register_forward_hook(lambda m, a, out: out if m.training else (out[0] * float("nan"), *out[1:]))
    with pytest.raises(TrainingDiverged, match=r"held-out loss is nan after step 2"):
        train(tiny_config(tmp_path, train__max_steps=4, eval__every=2), model=model,
              train_loader=SyntheticLoader(docs), eval_loader=SyntheticLoader(docs[:2], shuffle=False))
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in recs if r["kind"] == "train") == 2
    assert all(math.isfinite(r["loss"]) for r in recs if r["kind"] == "train")


def test_held_out_loss_builds_no_autograd_graph(lora_model, batches, monkeypatch):
    """evaluate_loss runs without gradients (a graph per batch would hold every activation until the sum is read)."""
    import chronicals.train.step as step

    seen = []

    def spy(model, batch, device):
        seen.append(torch.is_grad_enabled())
        return batch_loss_sum(model, batch, device)
    monkeypatch.setattr(step, "batch_loss_sum", spy)
    evaluate_loss(lora_model, batches, CPU)
    assert seen and not any(seen)


def test_another_runs_last_checkpoint_is_no_stopped_run_to_close(tmp_path, caplog):
    """A resume from ANOTHER run's last checkpoint (with held-out data) trains nothing and is no run "stopped before
    its closing evaluation": out_dir gets that run's records (its "after" left out, as metrics.py keeps them), and
    no closing evaluation runs there under the message meant for an interrupted run of this out_dir."""
    docs = synthetic_docs(40, seed=1)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    other = tmp_path / "other"
    other.mkdir()
    train(tiny_config(other, train__max_steps=2), model=tiny_model(), train_loader=SyntheticLoader(docs),
          eval_loader=ev())
    source = other / "run" / "checkpoints" / "step-000002"
    assert source.is_dir()
    with caplog.at_level(logging.INFO, logger="chronicals.train"):
        res = train(tiny_config(tmp_path, train__max_steps=2, train__resume=str(source)), model=tiny_model(),
                    train_loader=SyntheticLoader(docs), eval_loader=ev())
    assert res.status == "completed" and res.step == 2
    assert "before its closing evaluation" not in caplog.text
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r.get("tag") == "after"]
    assert res.eval_loss_after is None


def test_a_resume_to_an_earlier_last_step_closes_at_that_step(tmp_path):
    """A run of 4 steps (checkpoints 2 and 4, its closing
    "after" at step 4) resumed from its own step 2 with train.max_steps=2 finds step 2 its last. Its records past 2
    are another history: the rerun closes the run at step 2 (an "after" record at 2, the later steps dropped) rather
    than taking the step-4 "after" as this run's closing evaluation (metrics.jsonl kept describing steps 3-4 and a
    held-out loss of weights the final model does not hold)."""
    docs = synthetic_docs(40, seed=1)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    train(tiny_config(tmp_path, train__max_steps=4, train__save_every=2, train__keep_last=2), model=tiny_model(),
          train_loader=SyntheticLoader(docs), eval_loader=ev())
    source = tmp_path / "run" / "checkpoints" / "step-000002"
    assert source.is_dir()
    res = train(tiny_config(tmp_path, train__max_steps=2, train__resume=str(source)), model=tiny_model(),
                train_loader=SyntheticLoader(docs), eval_loader=ev())
    assert res.step == 2 and res.eval_loss_after is not None
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("tag") == "after"] == [2]
    assert max(r.get("step", 0) for r in records) == 2


def test_a_rerun_of_a_closed_run_reports_nothing_after(tmp_path):
    """A rerun that finds the
    run finished and closed (nothing to train, no closing evaluation due) calls no "after" report. With the CLI's
    RunReport and held-out QA (the demo), that report re-answers every held-out question greedily (minutes on a
    real model) and prints "== after training ==" for a run that did nothing."""
    docs = synthetic_docs(40, seed=1)
    ev = lambda: SyntheticLoader(docs[:4], shuffle=False)  # noqa: E731
    cfg = tiny_config(tmp_path, train__max_steps=2)
    train(cfg, model=tiny_model(), train_loader=SyntheticLoader(docs), eval_loader=ev())
    calls = []
    res = train(tiny_config(tmp_path, train__max_steps=2, train__resume="auto"), model=tiny_model(),
                train_loader=SyntheticLoader(docs), eval_loader=ev(),
                report=lambda event, **info: calls.append((event, info.get("eval_loss"))))
    assert res.step == 2 and res.eval_loss_after is None
    assert calls == []


def test_eval_path_auto_holds_out_nothing_beside_your_own_data(tmp_path):
    """data.eval_path=auto is the demo's held-out questions for data.path=demo only; beside a user's data it is no
    held-out set (the user's run must not be scored, and answer, on the packaged Vellmora questions)."""
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    cfg = from_dict({"data": {"path": str(data), "eval_path": "auto"}, "train": {"out_dir": str(tmp_path / "run")}})
    train, eval_file, qa = data_files(cfg, tmp_path / "run")
    assert train == [data] and eval_file is None and qa is None
    demo = from_dict({"data": {"path": "demo", "eval_path": "auto"}, "train": {"out_dir": str(tmp_path / "d")}})
    _, eval_file, qa = data_files(demo, tmp_path / "d")
    assert eval_file is not None and qa


def test_graphs_built_on_another_model_are_refused_without_replaying_them():
    """accumulate_gradients refuses a GraphedStep built on another model (its replay would train that model's
    parameters while this one's gradients stay untouched), before calling it."""
    model, other = tiny_model(), tiny_model()
    called = []
    graphs = SimpleNamespace(model=other, accumulate=lambda micro, count: called.append(count) or (torch.zeros(()), 0))
    with pytest.raises(ValueError, match="graphs was built on another model"):
        accumulate_gradients(model, [], CPU, graphs)
    assert not called


def _params_with_grad_norm(total: float) -> list:
    """Two fp32 parameters whose gradients together have norm ``total``."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 7)]
    grads = [torch.randn(p.shape, generator=g) for p in params]
    norm = torch.linalg.vector_norm(torch.cat(grads))
    for p, gr in zip(params, grads):
        p.grad = gr * (total / norm)
    return params


def _grad_norm(params) -> float:
    return torch.linalg.vector_norm(torch.cat([p.grad for p in params])).item()


def test_clip_grad_norm_returns_the_norm_before_clipping_and_clips_by_the_fp32_norm():
    """clip_grad_norm returns the norm before clipping (what a step logs as grad_norm and the divergence guard
    reads; the clipped norm would read max_norm on every clipped step), and scales by a coefficient from the fp32
    norm: fp32 gradients of norm 20.1425 clipped to 1.0 have norm 1.0 to fp32 precision (from the bf16-rounded
    norm, 20.125, they came out 1.0009)."""
    params = _params_with_grad_norm(5.0)
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(5.0, abs=1e-5)
    assert _grad_norm(params) == pytest.approx(1.0, abs=1e-5)
    params = _params_with_grad_norm(20.1425)
    assert torch.tensor(20.1425).bfloat16().item() == 20.125  # the rounding the fp32 norm avoids
    clip_grad_norm(params, 1.0)
    assert _grad_norm(params) == pytest.approx(1.0, abs=2e-6)


def test_eval_leaves_no_cache_entry_behind_for_a_qa_files_temporary_copy(tokenizer, tmp_path):
    """chronicals eval scores a QA file through a chat copy in a new temporary directory each time; cached, that copy
    made one tokenization-cache entry per edit of the QA file that no later run replaced (entries replace those of
    the same path), so the cache grew for good (a walk of chronicals eval). The copy is not cached; other data is."""
    from chronicals.evaluate import heldout_loader

    cache = tmp_path / "cache"
    train, qa = _train_and_qa(tmp_path, "")
    for answer in ("Paris", "Paris, France", "Paris!"):  # three edits of one QA file
        qa.write_text(json.dumps({"question": "Capital of France?", "answer": answer}) + "\n")
        loader, records = heldout_loader(DataSection(path=str(qa), max_seq_len=64, cache_dir=str(cache)), tokenizer,
                                         tmp_path / f"work-{len(answer)}")
        assert records[0]["answer"] == answer and len(loader.dataset) == 1
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())
    heldout_loader(DataSection(path=str(train), max_seq_len=64, cache_dir=str(cache)), tokenizer, tmp_path / "work")
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1  # text data still goes through it


def test_the_eval_summary_keeps_the_perplexitys_digits_and_says_what_was_split():
    """'perplexity 13' read as a rounded integer for 13.00 (4 significant digits, trailing zeros kept now), and
    '5 examples of 3 records' said nothing of the 2 records --on-long split had cut into pieces (a walk of chronicals
    eval)."""
    from chronicals.data.dataset import DatasetStats
    from chronicals.evaluate import EvalResult

    res = EvalResult(data="x.jsonl", loss=math.log(13.0), loss_tokens=40, examples=5,
                     stats=DatasetStats(records=3, documents=5, split=2, split_pieces=4))
    lines = res.summary().splitlines()
    assert lines[0] == "data: x.jsonl: 5 examples of 3 records (2 split into 4 pieces of --max-seq-len), 40 loss tokens"
    assert lines[1] == "held-out loss 2.5649, perplexity 13.00"
    assert EvalResult(data="x", loss=math.log(1.0115), loss_tokens=1, examples=1,
                      stats=DatasetStats()).summary().endswith("perplexity 1.012")


def test_the_demos_held_out_set_is_named_demo_not_auto(tokenizer, tmp_path, caplog):
    """The demo's defaults (data.path=demo, data.eval_path=auto) logged "the held-out set (the QA records of auto,
    rewritten as chat)": auto names no file; it resolves to the packaged questions, which data.eval_path=demo names."""
    from chronicals.train.setup import build_loaders

    with caplog.at_level(logging.INFO, logger="chronicals.data"):
        build_loaders(_cfg(tmp_path, "data.max_seq_len=256"), tokenizer, tmp_path / "run")
    assert "the held-out set (the QA records of demo, rewritten as chat)" in caplog.text, caplog.text
    assert "of auto" not in caplog.text
