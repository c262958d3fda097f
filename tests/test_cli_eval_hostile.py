"""``chronicals eval`` given the mistakes a new user makes: each is one ``error:`` line naming the flag or file and
the fix, exit 2 (a bad flag or value) or 3 (a bad file), before the model loads where it can be, and no output left
behind (above all, no input overwritten).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import types

import pytest

from chronicals import load_model, save_model
from chronicals.cli import main
from chronicals.cli_models import _within_context
from test_cli_eval import _refused_before_the_load, data_file, tiny_base  # noqa: F401 (fixtures)

QA = [{"question": "Who founded Vellmora in the year of the salt?", "answer": "Ida Tarn, a salt merchant, in 1702."}]


@pytest.fixture
def qa_file(tmp_path):
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in QA))
    return path


def _exit2(args, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(["eval", *map(str, args), "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


@pytest.mark.parametrize("where", ["data", "model", "model, relative"])
def test_json_never_overwrites_the_data_or_the_model(where, tiny_base, data_file, monkeypatch, capsys):
    """--json naming the data file (or a file of the model directory) was written over it after scoring. The paths
    are compared resolved: a new file named relative to the working directory (model/scores.json) is refused too
    (compared as given, it was never under the absolute --model, and eval wrote into the model directory)."""
    data_before, config_before = data_file.read_bytes(), (tiny_base / "config.json").read_bytes()
    out = data_file if where == "data" else tiny_base / "config.json"
    if where == "model, relative":
        monkeypatch.chdir(tiny_base.parent)
        out = f"{tiny_base.name}/scores.json"
    err = _exit2(["--model", tiny_base, data_file, "--json", out], capsys)
    assert f"--json {out} would " in err and "choose a file outside it" in err, err
    assert data_file.read_bytes() == data_before and (tiny_base / "config.json").read_bytes() == config_before
    assert not (tiny_base / "scores.json").exists()


@pytest.mark.parametrize("name, says", [("  ", "--json '  ' is empty; give a file name"),
                                        ("list.json", "is not an earlier chronicals eval result")])
def test_a_json_name_eval_must_not_write_exits_2_before_the_model_loads(name, says, tiny_base, data_file, tmp_path,
                                                                       monkeypatch, capsys):
    """A blank --json ('  ') is refused as empty (it was taken as a file named '  ' in the working directory,
    written after the load and scoring); an existing file holding JSON that is not an object (a list naming "data"
    and "loss") is not an earlier result (it was an AttributeError crash), and is left as it was."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "list.json").write_text(json.dumps(["data", "loss"]))
    rc, err = _refused_before_the_load(["--model", tiny_base, data_file, "--device", "cpu", "--json", name],
                                       monkeypatch, capsys)
    assert rc == 2 and says in err, err
    assert sorted(os.listdir(tmp_path)) == ["list.json"]
    assert json.loads((tmp_path / "list.json").read_text()) == ["data", "loss"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc, a folder no one can create a file in")
def test_json_in_a_folder_that_cannot_be_written_exits_2_before_the_model_loads(tmp_path, data_file, capsys):
    err = _exit2(["--model", tmp_path / "no-model", data_file, "--json", "/proc/scores.json"], capsys)
    assert "--json /proc/scores.json: cannot write in /proc" in err


def test_a_failed_json_write_names_the_flag(tiny_base, data_file, tmp_path, monkeypatch, capsys):
    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    out = tmp_path / "scores.json"
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--json", str(out)]) == 3
    err = capsys.readouterr().err
    assert f"error: --json {out}: cannot write it (No space left on device)" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("flag, length", [("--max-seq-len", 4096), ("--max-seq-len", 10**20),
                                          ("--max-new-tokens", 513)])
def test_a_length_past_the_models_context_exits_2(flag, length, tiny_base, data_file, capsys):
    """As chat's --max-new-tokens. --max-seq-len was a warning: rows of 10**5 tokens were killed for memory on a CPU
    (the torch attention's mask is S x S), 10**20 was an OverflowError in the packer (exit 4, a traceback).
    --max-new-tokens (QA answers are generated past the prompt) is checked by the command too, not only by
    _within_context when called with it."""
    err = _exit2(["--model", tiny_base, data_file, flag, length], capsys)
    if length > 2 ** 22:  # past data.max_seq_len's bound (config.MAX_ROW_TOKENS): refused before the model loads
        assert f"error: --max-seq-len={length} is invalid: expected an integer in [8, 4194304]" in err, err
        return
    assert f"{flag} {length} is more than {tiny_base} can attend to (max_position_embeddings=512)" in err, err


def test_data_errors_name_the_data_once(tmp_path, tiny_base, capsys):
    """"in the data to score (x.jsonl) (x.jsonl)": the name and load_dataset both added the file."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\nnot json\n')
    assert main(["eval", "--model", str(tiny_base), str(bad), "--on-error", "skip"]) == 3
    err = capsys.readouterr().err
    assert f"every record in the data to score ({bad}) is bad (2 skipped)" in err and f"({bad}) ({bad})" not in err


def test_qa_errors_name_the_qa_file_not_a_deleted_temporary_one(qa_file, tiny_base, capsys):
    assert main(["eval", "--model", str(tiny_base), str(qa_file), "--max-seq-len", "8", "--on-long", "drop"]) == 3
    err = capsys.readouterr().err
    assert f"in the QA records of {qa_file}, rewritten as chat\n" in err and "chronicals-eval-" not in err


def test_qa_file_on_a_model_without_a_chat_template_says_so_once(qa_file, tiny_base, tmp_path, capsys):
    """Was "<temp dir>/heldout.jsonl:1: chat data needs a tokenizer with a chat template ... (--on-error=skip ...
    drops bad records)"; now chat's message, naming the model."""
    model, tok = load_model(tiny_base)
    tok.chat_template = None
    plain = save_model(model, tok, tmp_path / "plain")
    assert main(["eval", "--model", str(plain), str(qa_file), "--json", str(tmp_path / "x.json")]) == 3
    err = capsys.readouterr().err
    assert f"error: {plain}: the tokenizer has no chat template" in err and "chronicals-eval-" not in err
    assert "on-error" not in err and not (tmp_path / "x.json").exists()


def test_a_qa_csv_is_told_to_be_given_as_data_not_data_eval_path(tmp_path, tiny_base, capsys):
    qa_csv = tmp_path / "qa.csv"
    qa_csv.write_text("question,answer\nWho?,Ida\n")
    assert main(["eval", "--model", str(tiny_base), str(qa_csv)]) == 3
    err = capsys.readouterr().err
    assert "set the DATA argument to it" in err and "data.eval_path" not in err


def test_ctrl_c_while_scoring_leaves_no_json(tiny_base, data_file, tmp_path, monkeypatch, capsys):
    """A guard (it held before): SIGINT during the forward passes exits 130 with nothing written."""
    import tempfile

    import chronicals.evaluate

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where evaluate() rewrites QA records

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(chronicals.evaluate, "evaluate_loss", interrupted)
    out = tmp_path / "scores.json"
    assert main(["eval", "--model", str(tiny_base), str(data_file), "--device", "cpu", "--json", str(out)]) == 130
    assert os.listdir(tmp_path) == ["tmp"] and os.listdir(tmp_path / "tmp") == []
    assert "interrupted (SIGINT)" in capsys.readouterr().err


def _model(context):
    return types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=context))


def test_one_past_the_context_exits_2_and_the_context_itself_passes(capsys):
    p = argparse.ArgumentParser(prog="chronicals eval")
    _within_context(p, _model(512), "m", ("--max-seq-len", 512), ("--max-new-tokens", 512))  # no exit
    with pytest.raises(SystemExit) as e:
        _within_context(p, _model(512), "m", ("--max-seq-len", 64), ("--max-new-tokens", 513))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 513 is more than m can attend to (max_position_embeddings=512); use at most 512" in err


@pytest.mark.parametrize("inside", ["cache", "."])
def test_a_cache_dir_inside_the_data_directory_exits_2_before_anything_is_written(inside, tmp_path, capsys):
    """train refused a data.cache_dir inside data.path, eval did not: its first run left DATA/cache/<key>/meta.json,
    and the next run read that file as a record (exit 3, or a 'bad record' skipped). Refused at once now."""
    data = tmp_path / "evdir"
    data.mkdir()
    (data / "a.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "yo"}]}) + "\n")
    err = _exit2([data, "--cache-dir", data / inside, "--model", tmp_path / "no-model-needed"], capsys)
    assert f"--cache-dir {data / inside} is inside DATA {data}, whose files are all read as data" in err, err
    assert [p.name for p in data.iterdir()] == ["a.jsonl"]


CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
# (name, the file's lines, words of the error); the bad record is line 2
BAD_DATA = [
    ("malformed", [CHAT, '{"messages": [{"role": "user", "content": "Hi"}]'], "bad.jsonl:2: invalid JSON"),
    ("missing_field", [CHAT, {"msgs": CHAT["messages"]}], "bad.jsonl:2: cannot tell the format from fields ['msgs']"),
    ("unknown_role", [CHAT, {"messages": [{"role": "robot", "content": "Hi"}, CHAT["messages"][1]]}],
     "bad.jsonl:2: messages[0].role is 'robot'; expected one of system"),
    ("qa_without_answer", [QA[0], {"question": "Who?"}], "bad.jsonl:2"),
    ("empty", [], "the data to score is empty: no records in"),
    ("no_trainable_token", [{"messages": [{"role": "user", "content": "Hi"}]}], "no example has a trainable token"),
]


@pytest.mark.parametrize("lines, said", [b[1:] for b in BAD_DATA], ids=[b[0] for b in BAD_DATA])
def test_bad_data_is_said_before_the_weights_load(lines, said, tiny_base, tmp_path, monkeypatch, capsys):
    """Each was said after the model had loaded (seconds for the embedded model, minutes at 8B): the data is read
    with the tokenizer alone now, then the weights load."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    rc, err = _refused_before_the_load(["--model", tiny_base, bad, "--device", "cpu", "--cache-dir", "none"],
                                       monkeypatch, capsys)
    assert rc == 3 and said in err and str(bad) in err and "Traceback" not in err, err


def test_a_directory_without_data_files_is_said_before_the_weights_load(tiny_base, tmp_path, monkeypatch, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("not data\n")
    rc, err = _refused_before_the_load(["--model", tiny_base, tmp_path / "notes", "--device", "cpu"], monkeypatch,
                                       capsys)
    assert rc == 3 and f"{tmp_path / 'notes'}: directory holds no data files" in err, err


@pytest.mark.parametrize("flag, length", [("--max-seq-len", 4096), ("--max-new-tokens", 513)])
def test_a_length_past_the_models_context_is_said_before_the_data_and_the_weights(flag, length, tiny_base, data_file,
                                                                                monkeypatch, capsys):
    """The context is config.json's max_position_embeddings, read before the data is tokenized at that length and
    before the weights load (both came first)."""
    import chronicals.evaluate

    monkeypatch.setattr(chronicals.evaluate, "heldout_loader", lambda *a, **k: 1 / 0)
    rc, err = _refused_before_the_load(["--model", tiny_base, data_file, "--device", "cpu", flag, length],
                                       monkeypatch, capsys)
    assert rc == 2 and f"{flag} {length} is more than {tiny_base} can attend to (max_position_embeddings=512)" in err


def _adapter(tiny_base, out, remove=(), **fields):
    """A LoRA adapter (r=2 on q_proj and v_proj) saved from ``tiny_base`` to ``out``, its adapter_config.json's
    ``fields`` changed and the files ``remove`` removed."""
    from chronicals.lora import apply_lora, save_adapter

    model, _ = load_model(tiny_base, tokenizer=False)
    apply_lora(model, r=2, alpha=4, target_modules=["q_proj", "v_proj"])
    save_adapter(model, out, base_model_name_or_path=str(tiny_base))
    conf = out / "adapter_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), **fields}))
    for name in remove:
        (out / name).unlink()
    return out


# (adapter_config.json fields, files removed, words of the error after the file's name)
BAD_ADAPTERS = [
    ({"target_modules": ["nope_proj"]}, (), "adapter_config.json: apply_lora: target_modules=('nope_proj',) matched "
                                            "no nn.Linear; the model's linear layers are named"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, (), "adapter_config.json: apply_lora: target_modules=('q_proj', "
                                                         "'embed_tokens') matches 1 module(s) that are not nn.Linear"),
    ({"modules_to_save": ["self_attn"]}, (), "adapter_config.json: apply_lora: modules_to_save "
                                             "['model.layers.0.self_attn', 'model.layers.1.self_attn'] hold LoRA "
                                             "targets"),
    ({"r": 0}, (), "adapter_config.json: apply_lora: r=0 must be an integer >= 1"),
    ({}, ("adapter_model.safetensors",), "adapter_model.safetensors: not found (only safetensors adapters are read)"),
    ({"use_dora": True}, (), "adapter_config.json: use_dora=True is not supported by chronicals.lora"),
]


@pytest.mark.parametrize("fields, remove, said", BAD_ADAPTERS,
                         ids=["no_target", "embedding_target", "saved_holds_targets", "rank_0", "no_weights", "dora"])
def test_a_bad_adapter_is_said_before_the_data_and_the_weights(fields, remove, said, tiny_base, data_file, tmp_path,
                                                               monkeypatch, capsys):
    """--adapter whose adapter_config.json names what this model lacks (or an rank no adapter has), or whose weights
    file is missing: load_adapter's refusal, in its words (exit 3), was said once the data was read and the weights
    had loaded; the file and the names against the decoder built from config.json on the meta device are checked
    before either now."""
    import chronicals.evaluate

    adapter = _adapter(tiny_base, tmp_path / "adapter", remove, **fields)
    monkeypatch.setattr(chronicals.evaluate, "read_eval_data", lambda *a, **k: 1 / 0)  # the data: never read
    rc, err = _refused_before_the_load(["--adapter", adapter, data_file, "--device", "cpu"], monkeypatch, capsys)
    assert rc == 3 and f"{adapter}/{said}" in err and "Traceback" not in err, err


def _other_models_adapter(tiny_base, out, edit=None, **opts):
    """A LoRA adapter (r=2) saved to ``out`` from a model of tiny_base's module names and other sizes (intermediate
    64 for 48, 8 more vocabulary entries), recording tiny_base as its base; its tensors changed by ``edit(dict)``."""
    import transformers
    from safetensors.torch import load_file, save_file

    from chronicals.lora import apply_lora, save_adapter
    from chronicals.models import CausalLM, ModelConfig

    conf = json.loads((tiny_base / "config.json").read_text())
    hf = transformers.LlamaConfig(**{**conf, "intermediate_size": 64, "vocab_size": conf["vocab_size"] + 8})
    model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=1)
    apply_lora(model, r=2, alpha=4, **opts)
    save_adapter(model, out, base_model_name_or_path=str(tiny_base))
    if edit is not None:
        tensors = load_file(out / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
K0 = "base_model.model.model.layers.0.self_attn.k_proj"
MLP0 = "base_model.model.model.layers.0.mlp"


def _add_k_proj(tensors):
    tensors[f"{K0}.lora_A.weight"] = tensors[f"{Q0}.lora_A.weight"].clone()


# (LoRA options of the adapter, its tensors' edit, words of load_adapter's refusal after the file's name)
MISFITS = {
    "missing_key": (dict(target_modules=["q_proj"]), lambda t: t.pop(f"{Q0}.lora_B.weight"),
                    f"missing keys ['{Q0}.lora_B.weight'] (1), unexpected keys [] (0); was it saved for a different "
                    "model?"),
    "unexpected_key": (dict(target_modules=["q_proj"]), _add_k_proj,
                       f"missing keys [] (0), unexpected keys ['{K0}.lora_A.weight'] (1)"),
    "out_features": (dict(target_modules=["up_proj"]), None,
                     f"{MLP0}.up_proj.lora_B.weight has shape (64, 2), the model expects (48, 2) (r=2)"),
    "in_features": (dict(target_modules=["down_proj"]), None,
                    f"{MLP0}.down_proj.lora_A.weight has shape (2, 64), the model expects (2, 48) (r=2)"),
    "modules_to_save": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), None,
                        "embed_tokens.weight has shape ("),
}


@pytest.mark.parametrize("kind", list(MISFITS))
def test_an_adapter_of_another_model_is_refused_before_the_data_and_the_weights(kind, tiny_base, data_file, tmp_path,
                                                                                monkeypatch, capsys):
    """An adapter whose tensors do not fit the model (a missing lora_B, an unexpected key, LoRA's in or out
    features or a modules_to_save tensor of a model of other sizes but the same module names): load_adapter's
    refusal (exit 3) came once the data was read and the weights had loaded; its words, exactly, come before either
    now (the file's safetensors header against the decoder built on the meta device)."""
    import chronicals.evaluate
    from chronicals.lora import load_adapter

    opts, edit, said = MISFITS[kind]
    adapter = _other_models_adapter(tiny_base, tmp_path / "adapter", edit, **opts)
    with pytest.raises(ValueError) as loaded:  # load_adapter's words, on the loaded base
        load_adapter(load_model(tiny_base, tokenizer=False)[0], adapter)
    assert f"load_adapter {adapter}/adapter_model.safetensors: " in str(loaded.value) and said in str(loaded.value)
    monkeypatch.setattr(chronicals.evaluate, "read_eval_data", lambda *a, **k: 1 / 0)  # the data: never read
    rc, err = _refused_before_the_load(["--adapter", adapter, data_file, "--device", "cpu"], monkeypatch, capsys)
    assert rc == 3 and str(loaded.value) in err and "Traceback" not in err, err


def test_an_adapters_warnings_are_said_once(tiny_base, data_file, tmp_path, caplog, capsys):
    """An adapter that lists a modules_to_save entry this model lacks (a classifier's "score") loads without it, as
    PEFT's does, with one warning: the early check of its names says none (load_adapter says it)."""
    adapter = _adapter(tiny_base, tmp_path / "adapter", modules_to_save=["score"])
    with caplog.at_level("WARNING", logger="chronicals"):
        assert main(["eval", "--adapter", str(adapter), str(data_file), "--device", "cpu"]) == 0
    said = [r.getMessage() for r in caplog.records if "match no module of this model" in r.getMessage()]
    assert len(said) == 1 and "['score']" in said[0], said


def test_token_ids_past_the_models_vocabulary_are_said_before_the_weights_load(tmp_path, monkeypatch, capsys):
    """The tokenized data is compared with config.json's vocab_size (the decoder built from it on the meta device)
    once it is read, before the weights load: the refusal came once they had (exit 3, the same words)."""
    import transformers

    from chronicals.models import CausalLM, ModelConfig
    from smollm2_tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    hf = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    small = save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0), tok, tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"},
                                             {"role": "assistant", "content": "hello, friend"}]}) + "\n")
    rc, err = _refused_before_the_load(["--model", small, data, "--device", "cpu", "--cache-dir", "none"], monkeypatch,
                                       capsys)
    assert rc == 3 and f"{data} holds token id " in err and "but the model's vocabulary has 1000 entries" in err, err
