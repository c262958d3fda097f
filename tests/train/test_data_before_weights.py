"""The data is read, checked and tokenized before the model's weights load: a malformed line, a missing field, an
unknown role, an empty file, a record the chat template refuses or a directory without data files is said in
seconds, naming the file and line, not after the weights load (seconds for the embedded model, minutes at 8B; a
walk of `chronicals train` with bad data files found every one of them after it). Only the tokenizer and the
model's config.json are read first, and the good case reads the data once and the weights once."""

from __future__ import annotations

import json

import pytest

import chronicals.train.loop as loop
from chronicals.cli import main

RUN = ["train.max_steps=1", "eval.every=0", "eval.qa=false", "logging.progress=false", "data.batch_size=2",
       "data.cache_dir=none", "model.device=cpu", "model.impl=torch"]
GOOD = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
        for i in range(4)]
# a template that refuses a system message, as Mistral v0.1's and Gemma's do
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# (name, what the file or directory holds, words of the error); the bad record is line 2 of its file
BAD = [
    ("malformed", _lines(GOOD[0], '{"messages": [{"role": "user", "content": "Hi"}]', GOOD[1]),
     "bad.jsonl:2: invalid JSON"),
    ("missing_field", _lines(GOOD[0], {"msgs": GOOD[1]["messages"]}, GOOD[1]),
     "bad.jsonl:2: cannot tell the format from fields ['msgs']"),
    ("unknown_role", _lines(GOOD[0], {"messages": [{"role": "robot", "content": "Hi"},
                                                   {"role": "assistant", "content": "Hello"}]}),
     "bad.jsonl:2: messages[0].role is 'robot'; expected one of system"),
    ("no_content", _lines(GOOD[0], {"messages": [{"role": "user"}, {"role": "assistant", "content": "Hello"}]}),
     "bad.jsonl:2: messages[0] has no 'content'"),
    ("template_refuses", _lines(GOOD[0], {"messages": [{"role": "system", "content": "Be brief."}, *GOOD[1]["messages"]]}),
     "bad.jsonl:2: the chat template refused this conversation: System role not supported"),
    ("empty", "", "is empty: no records in"),
    ("no_trainable_token", _lines({"messages": [{"role": "user", "content": "Hi"}]}),
     "no example has a trainable token"),
    ("no_data_files", None, "directory holds no data files (expected .jsonl"),
]


@pytest.fixture(scope="module")
def tiny_dir(save_tiny_base):
    """A tiny random Llama (HF directory) with the embedded SmolLM2 tokenizer, its chat template NO_SYSTEM."""
    from smollm2_tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    tok.chat_template = NO_SYSTEM
    return save_tiny_base(tok)


@pytest.fixture
def weights_refused(monkeypatch):
    """loop.load_base (the weights) fails the test if it is called; returns the calls."""
    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError("the model's weights were loaded before the data was checked")

    monkeypatch.setattr(loop, "load_base", refuse)
    monkeypatch.delenv("CHRONICALS_TRACEBACK", raising=False)
    return calls


def _bad(tmp_path, holds) -> str:
    """The bad data: a file bad.jsonl holding ``holds``, or (None) a directory with no data file in it."""
    if holds is None:
        (tmp_path / "notes").mkdir()
        (tmp_path / "notes" / "README.md").write_text("not data\n")
        return str(tmp_path / "notes")
    (tmp_path / "bad.jsonl").write_text(holds)
    return str(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("holds, said", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
def test_bad_data_is_said_before_the_weights_load(key, holds, said, tmp_path, tiny_dir, weights_refused, capsys):
    """Each bad input, as the training data or the held-out data: exit 3, one error line naming the file (and line),
    the weights never loaded, and out_dir left as it was (not created)."""
    bad = _bad(tmp_path, holds)
    good = tmp_path / "good" / "train.jsonl"
    good.parent.mkdir()
    good.write_text(_lines(*GOOD))
    data = [f"data.path={bad}"] if key == "data.path" else [f"data.path={good}", f"data.eval_path={bad}"]
    out = tmp_path / "run"
    assert main(["train", f"model.path={tiny_dir}", f"train.out_dir={out}", *RUN, *data]) == 3
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
    assert f"{bad}" in err, err
    assert not weights_refused and not out.exists()


def test_the_good_case_reads_the_data_once_then_the_weights_once(tmp_path, tiny_dir, monkeypatch):
    """The order that makes the refusals above come first: tokenizer, data, weights, each once (the tokenizer is
    the one the data was tokenized with, not loaded again with the weights)."""
    from chronicals.models import loading

    order = []
    real_loaders, real_base, real_tok = loop.build_loaders, loop.load_base, loading._tokenizer_in
    monkeypatch.setattr(loop, "build_loaders", lambda *a, **k: (order.append("data"), real_loaders(*a, **k))[1])
    monkeypatch.setattr(loop, "load_base", lambda *a, **k: (order.append("weights"), real_base(*a, **k))[1])
    # every tokenizer read goes through _tokenizer_in (load_tokenizer and tokenizer_and_config both call it)
    monkeypatch.setattr(loading, "_tokenizer_in", lambda *a, **k: (order.append("tokenizer"), real_tok(*a, **k))[1])
    (tmp_path / "train.jsonl").write_text(_lines(*GOOD))
    assert main(["train", f"model.path={tiny_dir}", f"train.out_dir={tmp_path / 'run'}", *RUN,
                 f"data.path={tmp_path / 'train.jsonl'}"]) == 0
    assert order == ["tokenizer", "data", "weights"], order
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_a_max_seq_len_past_the_models_context_is_said_before_the_data_and_the_weights(tmp_path, tiny_dir,
                                                                                       weights_refused, monkeypatch,
                                                                                       capsys):
    """data.max_seq_len past max_position_embeddings is read from config.json, before the data is tokenized at that
    length and before the weights load (it was said after both)."""
    monkeypatch.setattr(loop, "build_loaders", weights_refused.append)
    (tmp_path / "train.jsonl").write_text(_lines(*GOOD))
    assert main(["train", f"model.path={tiny_dir}", f"train.out_dir={tmp_path / 'run'}", *RUN,
                 f"data.path={tmp_path / 'train.jsonl'}", "data.max_seq_len=1024"]) == 2
    err = capsys.readouterr().err
    assert "data.max_seq_len=1024 is more than the model can attend to (max_position_embeddings=512)" in err, err
    assert f"{tiny_dir / 'config.json'}" in err and not weights_refused


# (overrides, config.json fields changed, exit status, words of the error): refused from config.json alone
FROM_CONFIG = [
    (["lora.targets=[q_proj, gate_porj]"], {}, 2,
     "config lora.targets does not fit model.path={model}: ['gate_porj'] match no module of the model"),
    (["lora.targets=[nope_proj]"], {}, 2, "config lora.targets does not fit model.path={model}: apply_lora: "
                                          "target_modules=('nope_proj',) matched no nn.Linear"),
    (["lora.modules_to_save=[nope]"], {}, 2, "config lora.modules_to_save does not fit model.path={model}: "
                                             "apply_lora: modules_to_save entries ['nope'] match no module"),
    ([], {"attention_dropout": 0.1}, 3, "config.json sets attention_dropout=0.1: transformers drops that share"),
    (["lora.enabled=false"], {"attention_dropout": 0.1}, 3, "config.json sets attention_dropout=0.1"),
]


@pytest.mark.parametrize("over, fields, rc, said", FROM_CONFIG, ids=["target_typo", "no_target", "modules_to_save",
                                                                     "attention_dropout", "attention_dropout_full"])
def test_what_config_json_refuses_is_said_before_the_data_and_the_weights(over, fields, rc, said, tmp_path, tiny_dir,
                                                                         weights_refused, monkeypatch, capsys):
    """A lora.targets / lora.modules_to_save name no module of the model has (the decoder built from config.json on
    the meta device tells its names), or a config.json whose attention_dropout a training step refuses: each was
    said after the data was read and the weights loaded (the attention_dropout one after the held-out loss before
    training, at the first step), in the same words."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, **fields}))
    monkeypatch.setattr(loop, "build_loaders", weights_refused.append)
    (tmp_path / "train.jsonl").write_text(_lines(*GOOD))
    out = tmp_path / "run"
    assert main(["train", f"model.path={model}", f"train.out_dir={out}", *RUN, f"data.path={tmp_path / 'train.jsonl'}",
                 *over]) == rc
    err = capsys.readouterr().err
    assert said.format(model=model) in err and "Traceback" not in err, err
    assert not weights_refused and not out.exists()


def test_token_ids_past_the_models_vocabulary_are_said_before_the_weights_load(tmp_path, tiny_dir, weights_refused,
                                                                               capsys):
    """A tokenizer that knows tokens the model lacks (config.json's vocab_size): the tokenized data is compared with
    the vocabulary of the decoder built from config.json on the meta device, before the weights load (it was after)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "vocab_size": 100}))
    (tmp_path / "train.jsonl").write_text(_lines(*GOOD))
    assert main(["train", f"model.path={model}", f"train.out_dir={tmp_path / 'run'}", *RUN,
                 f"data.path={tmp_path / 'train.jsonl'}"]) == 3
    err = capsys.readouterr().err
    assert "the training data holds token id " in err and "but the model's vocabulary has 100 entries" in err, err
    assert not weights_refused and not (tmp_path / "run").exists()
