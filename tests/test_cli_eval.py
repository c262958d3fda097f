"""``chronicals eval``: the trainer's held-out loss and QA score of a model (and adapter) on a data file, no training.

The expected numbers come from the trainer's own pieces called directly (load_dataset + PackedLoader as
train/setup.py builds the held-out loader, train/step.py evaluate_loss, train/qa.py answer_many), so a command that
computed anything else (a mean of batch means, loss on every token, another system message) fails here.

Also what it reports: the system message given (even the default text), a QA file's bad records counted, and its
notes and data warnings in eval's own flags, each once.
"""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch

from chronicals import load_model, save_model
from chronicals.cli import main
from chronicals.config import DEMO_SYSTEM_PROMPT, DataSection
from chronicals.data import PackedLoader, load_dataset
from chronicals.evaluate import evaluate, heldout_loader
from chronicals.models import CausalLM, ModelConfig
from chronicals.train.qa import answer_many, demo_file
from chronicals.train.step import evaluate_loss
from smollm2_tokenizer import smollm2_tokenizer

CPU = torch.device("cpu")
CHAT = [("What is the capital of Vellmora?", "Brask, on the northern coast."),
        ("Who founded Vellmora?", "Ida Tarn, a salt merchant, in 1702."),
        ("What does Vellmora export?", "Salt, wool and a very long list of small brass instruments.")]
COMPLETION = [("The national bird of Vellmora is", " the grey heron."),
              ("Vellmora's currency is called", " the tarn, divided into 100 grains.")]
QUICK = ["--max-new-tokens", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny random Llama with the embedded SmolLM2 tokenizer (real chat template), as an HF directory."""
    import transformers

    tok = smollm2_tokenizer()
    hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
    return save_model(model, tok, tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Chat records and prompt/completion records in one .jsonl (of unequal loss-token counts)."""
    path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
    lines = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in CHAT]
    lines += [{"prompt": p, "completion": c} for p, c in COMPLETION]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _eval(args, tmp_path, name="out.json") -> dict:
    out = tmp_path / name
    assert main(["eval", *map(str, args), "--device", "cpu", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _trainer_loss(model, tok, path, loss_on="assistant", batch_size=1, max_seq_len=64):
    """evaluate_loss over the loader train() builds for a held-out file."""
    ds = load_dataset([str(path)], tok, format="auto", max_seq_len=max_seq_len, loss_on=loss_on, cache_dir=None)
    loader = PackedLoader(ds, batch_size=batch_size, max_seq_len=max_seq_len, seed=0, shuffle=False)
    assert len(loader) > 1 and len({b.num_loss_tokens for b in loader}) > 1  # a mean of means would differ
    return (*evaluate_loss(model, loader, CPU), len(ds))


def test_the_loss_is_evaluate_loss_over_the_trainers_batches(tiny_base, data_file, tmp_path, capsys):
    model, tok = load_model(tiny_base)
    for loss_on in ("assistant", "all"):
        got = _eval(["--model", tiny_base, data_file, "--batch-size", "1", "--max-seq-len", "64",
                     "--train-on", loss_on], tmp_path)
        want, n, examples = _trainer_loss(model, tok, data_file, loss_on)
        assert got["loss"] == pytest.approx(want, rel=1e-9, abs=0) and got["loss_tokens"] == n
        assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-9)
        assert got["examples"] == examples == len(CHAT) + len(COMPLETION) and got["qa"] is None
        out = capsys.readouterr().out
        assert f"held-out loss {want:.4f}, perplexity {math.exp(want):#.4g}" in out and f"{n} loss tokens" in out


def test_an_adapter_changes_the_score_to_the_adapted_models(tiny_base, data_file, tmp_path, capsys):
    """--adapter (base taken from adapter_config.json) scores base + adapter: with B != 0 another loss, the one
    evaluate_loss gives for the model with that adapter."""
    from chronicals.lora import apply_lora, save_adapter

    model, tok = load_model(tiny_base)
    base_loss = _trainer_loss(model, tok, data_file)[0]
    apply_lora(model, r=2, alpha=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_base))
    got = _eval(["--adapter", adapter, data_file, "--batch-size", "1", "--max-seq-len", "64"], tmp_path)
    said = capsys.readouterr()
    assert f"--model not given: using {tiny_base}" in said.err
    assert said.out.startswith(f"model: {tiny_base} + adapter {adapter}\n"), said.out  # the summary says what scored
    want = _trainer_loss(model, tok, data_file)[0]
    assert got["loss"] == pytest.approx(want, rel=1e-6) and abs(got["loss"] - base_loss) > 1e-3
    assert got["adapter"] == str(adapter) and got["model"] == str(tiny_base)


def test_json_is_written_indented_and_ends_its_last_line(tmp_path):
    from chronicals.evaluate import write_json

    path = write_json(tmp_path / "scores.json", {"data": "x", "loss": 1.0})
    assert path.read_text() == '{\n  "data": "x",\n  "loss": 1.0\n}\n'


def test_json_is_written_atomically(tiny_base, data_file, tmp_path, monkeypatch, capsys):
    """A temporary file beside FILE renamed over it; a failed rename leaves the old FILE and no temporary file."""
    out = tmp_path / "scores.json"
    out.write_text('{"data": "x", "loss": 1.0}')  # an earlier result (eval writes over nothing else)
    real, renames = os.replace, []
    monkeypatch.setattr(os, "replace", lambda src, dst: (renames.append((str(src), str(dst))), real(src, dst))[1])
    got = _eval(["--model", tiny_base, data_file], tmp_path, "scores.json")
    [(src, dst)] = renames
    assert dst == str(out) and os.path.dirname(src) == str(tmp_path) and ".scores.json.tmp-" in src
    assert got["loss"] > 0 and sorted(os.listdir(tmp_path)) == ["scores.json"]

    def failing(src, dst):
        raise OSError(28, "No space left on device")

    old = '{"data": "x", "loss": 2.0}'
    out.write_text(old)
    monkeypatch.setattr(os, "replace", failing)
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--json", str(out)]) == 3
    assert "No space left on device" in capsys.readouterr().err
    assert out.read_text() == old and sorted(os.listdir(tmp_path)) == ["scores.json"]


def test_a_question_answer_file_gets_the_keyword_accuracy_of_greedy_answers(tiny_base, tmp_path):
    """QA records: answered as train answers them (no system message beside a file of your own, the demo's for
    demo), right when they contain every keyword; --qa-limit answers the first N."""
    model, tok = load_model(tiny_base)
    # a random model with tied embeddings echoes its last token, the template's "\n" (a blank answer): make the
    # word's row twice the newline's, so it follows "\n" and then itself
    nl = tok("\n", add_special_tokens=False)["input_ids"][-1]
    word = tok(" harbour", add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # lm_head's too (tied)
        emb[word] = 2 * emb[nl]
    parrot = save_model(model, tok, tmp_path / "parrot")
    questions = [q for q, _ in CHAT]
    said = answer_many(model, tok, questions, "", 6)
    kw = tok.decode([word]).strip()
    assert all(kw in a for a in said), said
    right = 1
    records = [{"question": q, "answer": "zqxj brass"} for q in questions]  # no keywords: the answer's text; wrong
    records[right]["keywords"] = [kw.upper()]  # case-insensitive
    records[right - 1]["keywords"] = [kw, "zqxj-never-said"]  # every keyword must be there
    qa_file = tmp_path / "heldout.jsonl"
    qa_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = _eval(["--model", parrot, qa_file, "--max-new-tokens", "6"], tmp_path)
    qa = got["qa"]
    assert (qa["correct"], qa["total"], qa["system_prompt"]) == (1, 3, "") and qa["accuracy"] == pytest.approx(1 / 3)
    assert [x["answer"] for x in qa["answers"]] == said
    assert [x["correct"] for x in qa["answers"]] == [i == right for i in range(3)]
    assert got["examples"] == 3 and got["loss_tokens"] > 0
    limited = _eval(["--model", parrot, qa_file, "--max-new-tokens", "6", "--qa-limit", str(right + 1)], tmp_path)
    assert (limited["qa"]["total"], limited["qa"]["correct"]) == (right + 1, 1) and limited["loss"] == got["loss"]
    assert [x["question"] for x in limited["qa"]["answers"]] == questions[:right + 1]  # the first, not the last
    # the answers depend on these: the file says them (a generation walk)
    assert (got["max_new_tokens"], got["qa_limit"]) == (6, 0) and limited["qa_limit"] == right + 1
    demo = _eval(["--model", tiny_base, "demo", "--max-new-tokens", "2", "--qa-limit", "2"], tmp_path)
    assert demo["qa"]["system_prompt"] == DEMO_SYSTEM_PROMPT and demo["qa"]["total"] == 2 and demo["examples"] > 2


@pytest.mark.parametrize("bad, says", [
    (["--max-seq-len", "4"], "--max-seq-len 4: expected an integer >= 8"),
    (["--batch-size", "0"], "--batch-size 0: expected an integer >= 1"),
    (["--qa-limit", "-1"], "--qa-limit -1: expected an integer >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: expected an integer >= 1"),
    (["--format", "yaml"], "argument --format: invalid choice: 'yaml'"),
    (["--device", "banana"], "--device=banana is not a device; use auto, cpu, cuda or cuda:N"),
    (["--json", "{tmp}"], "is a directory; give a file name"),
    (["--json", "{tmp}/no/such/dir/x.json"], "/no/such/dir does not exist; create it or choose another file"),
])
def test_bad_flags_exit_2_before_the_model_loads(bad, says, tmp_path, capsys):
    args = ["eval", "--model", str(tmp_path / "no-model"), str(tmp_path / "no-data.jsonl")]
    with pytest.raises(SystemExit) as e:
        main(args + [x.format(tmp=tmp_path) for x in bad])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_bad_files_exit_3_naming_the_file_and_the_flag(tiny_base, data_file, tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert main(["eval", "--model", str(tiny_base), str(missing)]) == 3
    err = capsys.readouterr().err
    assert f"error: {missing}: no such file or directory" in err and "Traceback" not in err
    # a data error names the eval flag, not the config key (data.on_long): every example is too long to keep
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--max-seq-len", "8", "--on-long", "drop"]) == 3
    err = capsys.readouterr().err
    assert "every example was dropped" in err and "--on-long=truncate" in err and "data.on_long" not in err


def test_usage_lists_eval(capsys):
    assert main(["--help"]) == 0
    assert "eval      score a base or fine-tuned model" in capsys.readouterr().out


def test_the_data_messages_name_the_options_the_caller_passes(tiny_base, tmp_path, caplog):
    """evaluate(option_names=) is what the data's warnings and errors call its options: eval's flags from chronicals
    eval, the config keys by default (what train says). It replaced a logging filter that rewrote every line of the
    shared chronicals.data and chronicals.train loggers while eval ran (any other thread's lines too)."""
    import logging

    from chronicals.config import DataSection
    from chronicals.data import DataError
    from chronicals.evaluate import evaluate

    model, tok = load_model(str(tiny_base), device=torch.device("cpu"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("short one", "word " * 60, "another short")))
    flags = {"max_seq_len": "--max-seq-len", "overlong": "--on-long", "on_error": "--on-error"}
    opts = DataSection(path=str(data), max_seq_len=16, on_long="drop", cache_dir="none")
    for names, says in ((flags, ("--max-seq-len", "--on-long=drop")), (None, ("data.max_seq_len", "data.on_long=drop"))):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="chronicals.data"):
            evaluate(model, tok, opts, CPU, option_names=names)
        assert f"1 longer than {says[0]}=16 (dropped, {says[1]}" in caplog.text, caplog.text
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "a?", "answer": "b"}) + "\n{broken\n")
    with pytest.raises(DataError, match=r":2: .*\(--on-error=skip drops bad records"):
        evaluate(model, tok, DataSection(path=str(qa), cache_dir="none"), CPU, option_names=flags)
    assert not logging.getLogger("chronicals.data").filters and not logging.getLogger("chronicals.train").filters


@pytest.mark.parametrize("system, shown", [("", "system message none (the chat template's default))"),
                                           ("none", "system message 'none')"),
                                           (DEMO_SYSTEM_PROMPT, f"system message {DEMO_SYSTEM_PROMPT!r})")])
def test_the_summary_tells_no_system_message_from_one_that_reads_none(system, shown):
    """No system message was printed as 'none', quoted like the message --system-prompt none gives."""
    from chronicals.data.dataset import DatasetStats
    from chronicals.evaluate import EvalResult
    from chronicals.train.qa import QAResult

    res = EvalResult(data="qa.jsonl", loss=1.0, loss_tokens=2, examples=1, stats=DatasetStats(records=1),
                     system_prompt=system, answers=QAResult(answers=["4"], correct=[True]))
    assert res.summary().splitlines()[-1].endswith(shown), res.summary()


def test_the_summary_counts_the_right_answers_of_all_asked():
    from chronicals.data.dataset import DatasetStats
    from chronicals.evaluate import EvalResult
    from chronicals.train.qa import QAResult

    res = EvalResult(data="qa.jsonl", loss=1.0, loss_tokens=2, examples=3, stats=DatasetStats(records=3),
                     system_prompt="", answers=QAResult(answers=["4", "5", "6"], correct=[True, False, False]))
    assert "keywords: 33% (1/3; greedy" in res.summary(), res.summary()


@pytest.fixture()
def qa3(tmp_path):
    path = tmp_path / "qa3.jsonl"
    path.write_text("".join(demo_file("heldout.jsonl").read_text().splitlines(keepends=True)[:3]))
    return path


def test_a_system_prompt_given_is_used_even_when_it_is_the_default_text(tiny_base, qa3, tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert plain["qa"]["system_prompt"] == ""  # beside a file other than demo: none, as train asks
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out),
                 "--system-prompt", DEMO_SYSTEM_PROMPT]) == 0
    given = json.loads(out.read_text())
    assert given["qa"]["system_prompt"] == DEMO_SYSTEM_PROMPT and given["loss"] != plain["loss"]
    assert f"system message {DEMO_SYSTEM_PROMPT!r}" in capsys.readouterr().out


def test_a_qa_files_bad_records_are_counted_in_the_summary_and_json(tiny_base, qa3, tmp_path, capsys):
    bad = tmp_path / "qa_bad.jsonl"
    bad.write_text(qa3.read_text() + '{"question": "x"}\nnot json\n')
    out = tmp_path / "e.json"
    assert main(["eval", "--model", str(tiny_base), str(bad), *QUICK, "--on-error", "skip", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "3 examples of 5 records" in said and "2 bad records skipped" in said, said
    got = json.loads(out.read_text())
    assert (got["examples"], got["records"]) == (3, 5)
    # the summary's counts are in the JSON too (it had only records and examples: a walk of chronicals eval)
    assert (got["skipped_errors"], got["truncated"], got["split"], got["dropped_no_loss"]) == (2, 0, 0, 0), got


def test_a_long_json_name_is_written(tiny_base, qa3, tmp_path):
    """A 250-byte name is valid; the temporary '.<name>.tmp-<pid>' beside it was not (File name too long)."""
    out = tmp_path / ("e" * 245 + ".json")
    assert main(["eval", "--model", str(tiny_base), str(qa3), *QUICK, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["examples"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_warnings_about_a_qa_file_do_not_name_the_deleted_copy(tiny_base, tmp_path, caplog):
    long_q = tmp_path / "qa_long.jsonl"
    long_q.write_text(json.dumps({"question": "q1", "answer": "a1"}) + "\n"
                      + json.dumps({"question": "long " * 60, "answer": "a2"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), str(long_q), *QUICK, "--max-seq-len", "40"]) == 0
    said = "\n".join(r.getMessage() for r in caplog.records if r.name == "chronicals.data")
    assert said and "chronicals-eval-" not in said, said


def test_system_prompt_without_qa_records_is_noted(tiny_base, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"},
                                             {"role": "assistant", "content": "Hello, how can I help?"}]}) + "\n")
    assert main(["eval", "--model", str(tiny_base), str(data), "--device", "cpu", "--system-prompt", "Be brief."]) == 0
    err = capsys.readouterr().err
    assert "note: --system-prompt has no effect" in err and "holds no question/answer records" in err
    assert main(["eval", "--model", str(tiny_base), str(data), "--device", "cpu"]) == 0  # not given: no note
    assert "has no effect" not in capsys.readouterr().err


def test_evals_data_warnings_name_its_flags_not_config_keys(tiny_base, tmp_path, caplog):
    """chronicals eval's errors said --on-long / --max-seq-len, but its warnings still said the config keys:
    "1 longer than max_seq_len=16 (dropped, data.on_long=drop)", "raise data.max_seq_len", which eval has no
    way to set."""
    import json

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("short one", "word " * 60, "another short")))
    with caplog.at_level("WARNING", logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), "--device", "cpu", "--max-seq-len", "16", "--on-long", "drop",
                     "--cache-dir", "none", str(data)]) == 0
    said = caplog.text
    assert "--on-long=drop" in said, said
    assert "data.on_long" not in said and "data.max_seq_len" not in said, said


def test_a_data_directorys_unread_files_are_warned_about_once(tiny_base, tmp_path, caplog):
    """chronicals eval DIR (and train's data.eval_path=DIR) printed "DIR: 1 file not read: x.jsonl.gz ..." twice:
    once from the peek for question/answer records, once from the load."""
    import json

    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (d / "b.jsonl.gz").write_bytes(b"")
    with caplog.at_level("WARNING", logger="chronicals.data"):
        assert main(["eval", "--model", str(tiny_base), "--device", "cpu", "--cache-dir", "none", str(d)]) == 0
    assert caplog.text.count("1 file not read") == 1, caplog.text


def test_eval_passes_num_proc_and_on_long_split_to_the_data(tiny_base, data_file, monkeypatch):
    """--num-proc (the fix a dead tokenizer worker's error names) and --on-long split reach load_dataset, not
    accepted and dropped."""
    import chronicals.data as data_pkg

    seen, real = [], data_pkg.load_dataset
    monkeypatch.setattr(data_pkg, "load_dataset", lambda *a, **k: (seen.append(k), real(*a, **k))[1])
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--max-seq-len", "16",
                 "--on-long", "split", "--num-proc", "1", "--cache-dir", "none"]) == 0
    assert seen and seen[-1]["num_proc"] == 1 and seen[-1]["overlong"] == "split", seen


def test_eval_json_replaces_an_earlier_result_but_no_other_file(tiny_base, data_file, tmp_path, capsys):
    """--json over an existing file replaced it whatever it was (another run's adapter_config.json or config.yaml,
    which chat / eval / train read back; a docs walk): only an earlier eval result (a JSON object with "data" and
    "loss") is written over; a directory is said before the scoring, not when the rename onto it fails."""
    first = _eval(["--model", tiny_base, data_file], tmp_path, "e.json")
    assert _eval(["--model", tiny_base, data_file], tmp_path, "e.json") == first  # an earlier result: replaced
    others = {"adapter_config.json": '{"peft_type": "LORA"}', "config.yaml": "model: x\n",
              "metrics.json": '{"loss": 1.0, "step": 3}'}  # JSON, not JSON, a loss without data
    folder = tmp_path / "folder"
    folder.mkdir()
    targets = [(tmp_path / n, "exists and is not an earlier chronicals eval result") for n in others]
    for (target, says) in targets + [(folder, "is a directory")]:
        if target.name in others:
            target.write_text(others[target.name])
        with pytest.raises(SystemExit) as e:
            main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--json", str(target)])
        assert e.value.code == 2 and says in capsys.readouterr().err, target
    assert {n: (tmp_path / n).read_text() for n in others} == others


def test_evaluate_refuses_a_token_id_equal_to_the_vocabulary_size(tmp_path):
    """An id equal to the model's vocabulary size (one past its last embedding row) is evaluate's ValueError naming
    the data and the id, before any forward pass, not the model's own IndexError; one row more and it runs."""
    import transformers

    tok = smollm2_tokenizer()
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"text": "Paris is the capital of France."}) + "\n")
    data = DataSection(path=str(f), format="text", train_on="all", max_seq_len=64, cache_dir="none")
    top = int(heldout_loader(data, tok, tmp_path / "w")[0].dataset.ids.max())

    def model(vocab):
        hf = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True, eos_token_id=0)
        return CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)

    with pytest.raises(ValueError, match=rf"holds token id {top}, but the model's vocabulary has {top} entries"):
        evaluate(model(top), tok, data, CPU)
    assert evaluate(model(top + 1), tok, data, CPU).loss_tokens > 0


def test_json_writes_null_for_a_non_finite_loss(tiny_base, data_file, tmp_path, monkeypatch):
    """A non-finite loss is null in --json (strict JSON), as its perplexity is: a bare NaN makes the file
    unreadable by JSON.parse and other strict readers."""
    import chronicals.evaluate as ev

    monkeypatch.setattr(ev, "evaluate_loss", lambda model, loader, device: (float("nan"), 7))
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--cache-dir", "none",
                 "--json", str(out)]) == 0
    text = out.read_text()
    got = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c} in {text}"))
    assert got["loss"] is None and got["perplexity"] is None and got["loss_tokens"] == 7


def test_json_into_the_adapter_directory_is_refused(tiny_base, data_file, tmp_path, capsys):
    """--json FILE inside the --adapter directory is refused before the load (exit 2): written there, it is a
    foreign file in out_dir/adapter, which a later final save of that run refuses to replace."""
    from chronicals.lora import apply_lora, save_adapter

    model, _ = load_model(str(tiny_base), device="cpu")
    apply_lora(model, r=2, alpha=4)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_base))
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--adapter", str(adapter), str(data_file), "--device", "cpu", "--cache-dir", "none",
              "--json", str(adapter / "scores.json")])
    assert exit_.value.code == 2 and "would write into --adapter" in capsys.readouterr().err
    assert not (adapter / "scores.json").exists()


def test_json_records_the_data_settings_it_scored_under(tiny_base, data_file, tmp_path):
    """--json records the settings the numbers depend on, so two result files can be compared: --on-long changes
    which tokens are scored (drop / split / truncate), --train-on which carry loss. --max-new-tokens and --qa-limit
    only for question/answer records, whose answers depend on them: a file without any claimed generation settings
    that had no effect on its numbers."""
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--cache-dir", "none",
                 "--on-long", "split", "--train-on", "all", "--max-seq-len", "32", "--batch-size", "2",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["on_long"], got["train_on"], got["max_seq_len"], got["batch_size"], got["model"], got["device"]) == \
        ("split", "all", 32, 2, str(tiny_base), "cpu"), got
    assert got["dtype"] == "float32" and got["adapter"] is None, got  # the dtype's name, as --dtype takes it
    assert "max_new_tokens" not in got and "qa_limit" not in got, got


def _refused_before_the_load(args, monkeypatch, capsys):
    """(exit status, stderr) of ``chronicals eval ARGS``, which must not have loaded a model."""
    import chronicals.cli_eval as cli_eval

    loads = []
    monkeypatch.setattr(cli_eval, "_load", lambda *a, **k: loads.append(a) or 1 / 0)
    try:
        rc = main(["eval", *map(str, args)])
    except SystemExit as e:
        rc = e.code
    assert not loads, "the model was loaded before the refusal"
    return rc, capsys.readouterr().err


def test_an_empty_data_argument_is_refused(tiny_base, tmp_path, monkeypatch, capsys):
    """DATA '' (or blanks) is refused: Path('') is the working directory, which would be read whole as data."""
    monkeypatch.chdir(tmp_path)
    rc, err = _refused_before_the_load(["--model", tiny_base, "  ", "--device", "cpu"], monkeypatch, capsys)
    assert rc == 2 and "the data argument is empty" in err, err


def test_a_system_prompt_that_is_not_utf8_is_refused(tiny_base, data_file, monkeypatch, capsys):
    """A prompt of undecodable bytes (a shell in another locale gives surrogate escapes) is exit 2 naming the flag,
    before the model loads."""
    rc, err = _refused_before_the_load(["--model", tiny_base, data_file, "--device", "cpu",
                                        "--system-prompt", "caf\udce9"], monkeypatch, capsys)
    assert rc == 2 and "--system-prompt is not valid UTF-8" in err, err


def test_missing_data_is_said_before_the_model_loads(tiny_base, tmp_path, monkeypatch, capsys):
    """A DATA path that does not exist is said before the model loads (minutes at 8B), naming the path."""
    rc, err = _refused_before_the_load(["--model", tiny_base, tmp_path / "nope.jsonl", "--device", "cpu"],
                                       monkeypatch, capsys)
    assert rc != 0 and "nope.jsonl: no such file or directory" in err, err


def test_a_loss_past_exps_range_has_infinite_perplexity():
    """exp of a loss above ~709.8 overflows: the perplexity is +inf, printed as inf, not nan (which reads as a
    broken computation)."""
    from chronicals.data import DatasetStats
    from chronicals.evaluate import EvalResult

    r = EvalResult(data="x", loss=1000.0, loss_tokens=3, examples=1, stats=DatasetStats(records=1, documents=1))
    assert r.perplexity == math.inf and "perplexity inf" in r.summary()


def test_an_infinite_perplexity_is_null_in_json():
    from chronicals.data import DatasetStats
    from chronicals.evaluate import EvalResult

    r = EvalResult(data="x", loss=1000.0, loss_tokens=3, examples=1, stats=DatasetStats(records=1, documents=1))
    got = json.loads(json.dumps(r.as_dict(), allow_nan=False))
    assert got["loss"] == 1000.0 and got["perplexity"] is None, got


def test_the_summary_names_evals_own_flag_for_truncation():
    """eval has no data.max_seq_len: its summary names --max-seq-len, what the user can change."""
    from chronicals.data import DatasetStats
    from chronicals.evaluate import EvalResult

    stats = DatasetStats(records=3, documents=3, truncated=2)
    r = EvalResult(data="x", loss=1.0, loss_tokens=3, examples=3, stats=stats)
    assert "2 truncated to --max-seq-len" in r.summary(), r.summary()


def test_evaluate_warns_of_a_max_seq_len_past_the_models_context(monkeypatch, caplog):
    """From Python (the CLI refuses earlier): rows past the model's trained positions are warned of, since their
    loss says little."""
    import types

    import chronicals.evaluate as ev
    from chronicals.config import DataSection

    def stop(*a, **k):
        raise RuntimeError("stop here")
    monkeypatch.setattr(ev, "heldout_loader", stop)
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64))
    with caplog.at_level(logging.WARNING, logger="chronicals.evaluate"), pytest.raises(RuntimeError, match="stop"):
        ev.evaluate(model, None, DataSection(path="x.jsonl", max_seq_len=128), CPU)
    assert "max_seq_len=128 is longer than the model's max_position_embeddings=64" in caplog.text


class _Loaded(Exception):
    """Raised where eval loads the model: what came before it is what a test checks."""


def test_data_under_home_is_found_and_demo_beside_a_demo_folder_is_warned_of(tiny_base, tmp_path, monkeypatch,
                                                                              caplog):
    """DATA ~/x.jsonl is the file under $HOME (was "no such file or directory" with the ~ taken literally), and
    DATA demo where the working directory holds a demo folder warns that the packaged data is read, not ./demo
    (train says so for data.path; eval said nothing), and --json demo/eval.json there is not "inside DATA". All
    before the model loads."""
    import chronicals.cli_eval as cli_eval

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.jsonl").write_text('{"text": "a record"}\n')
    monkeypatch.setattr(cli_eval, "_load", lambda *a, **k: (_ for _ in ()).throw(_Loaded()))
    with pytest.raises(_Loaded):
        cli_eval.cmd_eval(["~/x.jsonl", "--model", str(tiny_base), "--device", "cpu"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    with caplog.at_level("WARNING"), pytest.raises(_Loaded):
        cli_eval.cmd_eval(["demo", "--model", str(tiny_base), "--device", "cpu"])
    assert "DATA=demo is chronicals' packaged demo data, not ./demo in this directory; to read that one, pass " \
           "DATA=./demo" in caplog.text, caplog.text
    with pytest.raises(_Loaded):  # the README's --json runs/demo/eval.json, typed from runs/: ./demo is not DATA
        cli_eval.cmd_eval(["demo", "--model", str(tiny_base), "--device", "cpu", "--json", "demo/eval.json"])
    (tmp_path / "mine").mkdir()
    with pytest.raises(SystemExit) as exit_:  # DATA a folder of the user's: still guarded
        cli_eval.cmd_eval(["mine", "--model", str(tiny_base), "--device", "cpu", "--json", "mine/eval.json"])
    assert exit_.value.code == 2
