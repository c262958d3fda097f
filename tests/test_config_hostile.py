"""Hostile input to the YAML config and the train command line: each fails as one clear error (file, line, key,
what to do) or is read as written, never as a traceback or a silently changed value."""

from __future__ import annotations

import pytest

from chronicals.cli import main
from chronicals.config import MAX_ROW_TOKENS, from_dict, load_config


@pytest.mark.parametrize("value", ["[1", "@x", "%x", "`x", "*x"])
def test_an_override_value_that_is_no_yaml_is_a_config_error(value):
    with pytest.raises(ValueError, match=r"^command line: config optim\.lr=.* is invalid: expected a number"):
        load_config(None, [f"optim.lr={value}"])


def test_an_override_value_that_is_no_yaml_exits_2_without_a_traceback(capsys):
    assert main(["train", "optim.lr=[1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err and "optim.lr" in err


@pytest.mark.parametrize("override, expected", [
    ("data.system_prompt=You are #1", "You are #1"),  # YAML would cut it at the '#'
    ("data.system_prompt=Answer: briefly", "Answer: briefly"),  # YAML would read a mapping
    ("data.system_prompt=[Note] be brief", "[Note] be brief"),  # not YAML at all
    ("data.system_prompt=yes", "yes"),  # YAML 1.1 reads True
    ("train.out_dir=0x10", "0x10"),  # YAML reads 16
    ("train.out_dir=010", "010"),  # YAML reads 8
    ("train.out_dir=1_000", "1_000"),  # YAML reads 1000
    ("data.system_prompt='quoted'", "quoted"),  # quotes are still taken off
    ("data.system_prompt=", ""),
    ("data.system_prompt=null", ""),
    # YAML reads a leading '#' as a comment: the prompt became '' (the template's default), eval_path '' (none)
    ("data.system_prompt=# Role: a terse pirate", "# Role: a terse pirate"),
    ("data.eval_path=#held.jsonl", "#held.jsonl"),
    ("data.system_prompt='Be brief' #1 rule", "'Be brief' #1 rule"),  # quoted at the start only: not a quoted value
])
def test_string_overrides_are_taken_as_written(override, expected):
    key, _ = override.split("=", 1)
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [override]), section), name) == expected


def test_the_auto_bool_words_still_work_as_overrides():
    c = load_config(None, ["optim.fused=on", "optim.master_weights=0", "train.cuda_graphs=no"])
    assert (c.optim.fused, c.optim.master_weights, c.train.cuda_graphs) == ("true", "false", "false")


@pytest.mark.parametrize("text, expected", [
    ("data:\n  system_prompt: yes\n", "yes"),
    ("train:\n  out_dir: 0x10\n", "0x10"),
    ("train:\n  out_dir: 1_000\n", "1_000"),
    ("train:\n  out_dir: 2024-01-01\n", "2024-01-01"),
    ("data:\n  path: 123\n", "123"),
])
def test_string_keys_in_a_file_are_taken_as_written(tmp_path, text, expected):
    (tmp_path / "c.yaml").write_text(text)
    c = load_config(tmp_path / "c.yaml")
    section, name = text.split(":")[0], text.split("\n")[1].split(":")[0].strip()
    assert getattr(getattr(c, section), name) == expected


def test_auto_bool_keys_in_a_file_still_take_yaml_booleans(tmp_path):
    (tmp_path / "c.yaml").write_text("optim:\n  fused: on\ntrain:\n  cuda_graphs: no\n")
    c = load_config(tmp_path / "c.yaml")
    assert (c.optim.fused, c.train.cuda_graphs) == ("true", "false")


def test_a_config_that_is_not_utf8_names_the_file_line_and_the_fix(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes(b"optim:\n  lr: 1e-3\n  # caf\xe9\n")
    with pytest.raises(ValueError, match=rf"^{p}:3:8: .*not UTF-8.*save .* as UTF-8"):
        load_config(p)


def test_a_control_character_in_the_config_names_its_line(tmp_path):
    p = tmp_path / "nul.yaml"
    p.write_bytes(b"optim:\n  lr: 0.001\x00\n")
    with pytest.raises(ValueError, match=rf"^{p}:2:12: invalid YAML: character U\+0000 is not allowed"):
        load_config(p)


def test_a_key_from_a_merge_names_its_section_line(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("optim: &o\n  lr: 0.1\nschedule:\n  <<: *o\n")
    with pytest.raises(ValueError, match=rf"^{p}:3: unknown config key 'schedule\.lr'"):
        load_config(p)


@pytest.mark.parametrize("argv, message", [
    (["--config", "x.yaml"], r"--config is not an option.*chronicals train x\.yaml"),
    (["-v"], r"-v is not an option"),
    (["optim.lr"], r"override 'optim\.lr' is not key=value"),
    (["c.txt"], r"c\.txt: a config file must end in \.yaml or \.yml"),
    (["a.yaml", "b.yaml"], r"one CONFIG\.yaml at most, got a\.yaml and b\.yaml"),
    # a '/' before the '=': a path, not an override ("unknown config key 'runs/lr'" and the 60 keys, before)
    (["runs/lr=3e-4/x.yaml"], r"config file runs/lr=3e-4/x\.yaml not found"),
])
def test_train_arguments_that_are_neither_a_config_nor_an_override_say_what_to_do(argv, message, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(message, err), err


@pytest.mark.parametrize("text, message", [
    ("optim.lr: 1e-4\n", r"c\.yaml:1: config key 'optim\.lr' is dotted: .*'optim:' on one line and '  lr: VALUE'"),
    ("train:\n  lr: 1e-4\n", r"c\.yaml:2: unknown config key 'train\.lr'; did you mean optim\.lr or"),
    ("lr: 1e-4\n", r"c\.yaml:1: unknown config key 'lr'; did you mean optim\.lr"),
])
def test_a_key_in_the_wrong_place_is_pointed_to_its_section(tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("override, message", [
    ("train.lr=1e-4", r"did you mean optim\.lr or"),
    ("OPTIM.LR=1e-4", r"did you mean optim\.lr or"),
])
def test_an_override_in_the_wrong_section_or_case_suggests_the_key(override, message):
    with pytest.raises(ValueError, match=rf"^command line: unknown config key .*{message}"):
        load_config(None, [override])


def test_boolean_keys_take_1_and_0_as_bool_words_says(tmp_path):
    (tmp_path / "c.yaml").write_text("lora:\n  enabled: 0\n")
    assert load_config(tmp_path / "c.yaml", ["model.checkpointing=1"]).lora.enabled is False
    assert load_config(None, ["model.checkpointing=1"]).model.checkpointing is True
    with pytest.raises(ValueError, match=r"lora\.enabled=2 is invalid: expected true or false"):
        load_config(None, ["lora.enabled=2"])


def test_a_number_key_refuses_a_boolean(tmp_path):
    """A float key refuses a boolean: optim.lr=true on the command line, lr: yes in a file and a dict's False fail as
    "expected a number" naming where the value came from (float(True) made the learning rate 1.0); an integer is
    still a number."""
    with pytest.raises(ValueError, match=r"^command line: config optim\.lr=True is invalid: expected a number"):
        load_config(None, ["optim.lr=true"])
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: yes\n")
    with pytest.raises(ValueError, match=rf"^{f}:2: config optim\.lr=.* is invalid: expected a number"):
        load_config(f)
    with pytest.raises(ValueError, match=r"lora\.dropout=.* is invalid: expected a number"):
        from_dict({"lora": {"dropout": False}})
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


def test_a_config_that_cannot_be_read_is_a_config_error(tmp_path, monkeypatch, capsys):
    """A permission error (not reproducible as root, so faked) exits 2 with the file named, not 3 or 4."""
    from pathlib import Path

    cfg = tmp_path / "c.yaml"
    cfg.write_text("train:\n  max_steps: 1\n")
    real = Path.read_bytes

    def denied(self):
        if self == cfg:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(ValueError, match=r"config file .*c\.yaml cannot be read \(Permission denied\); check its"):
        load_config(cfg)
    assert main(["train", str(cfg)]) == 2
    assert "cannot be read" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_config_says_it_sets_nothing(tmp_path, caplog, text):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with caplog.at_level("WARNING", logger="chronicals.config"):
        load_config(cfg)
    assert "c.yaml sets nothing: every key takes its default" in caplog.text


def test_a_section_with_no_keys_under_it_is_said(tmp_path, caplog):
    """'data:' with its keys not indented under it (YAML null) silently trained the embedded demo data."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  path: m\ndata:\npath: mine.jsonl\n".replace("path: mine", "# path: mine"))
    with caplog.at_level("WARNING", logger="chronicals.config"):
        c = load_config(cfg)
    assert c.data.path == "demo"
    assert "c.yaml:3: section data: has no keys under it, so every data.* key takes its default (data.path=demo" \
        in caplog.text and "model" not in caplog.text


def test_a_config_path_with_an_equals_sign_is_read_as_the_config(tmp_path, capsys):
    """runs/lr=3e-4/x.yaml is an existing file, not an override of a key 'runs/lr'; data.path=x.yaml stays one."""
    cfg = tmp_path / "lr=3e-4" / "x.yaml"
    cfg.parent.mkdir()
    cfg.write_text("optim:\n  lr: abc\n")
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}:2" in err and "optim.lr" in err and "unknown" not in err
    assert main(["train", "data.path=" + str(cfg), "data.format=nope"]) == 2  # overrides: the file is not read
    err = capsys.readouterr().err
    assert "command line: config data.format='nope'" in err and f"{cfg}:" not in err


@pytest.mark.parametrize("override,said", [
    ("optim.lr=1" + "0" * 400, "expected a number"),
    ("lora.targets=[q_proj", "an unclosed bracket"),
    ("model.recompute=null", "expected a list such as [norm, swiglu]"),
    # was exit 3 blaming the run's own copy of the demo data (out_dir/data/train.jsonl)
    ("data.format=text", "config data.format='text' does not fit data.path=demo: the demo data is chat records"),
])
def test_config_values_that_were_tracebacks_or_misread(override, said, capsys):
    assert main(["train", override]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [
    ("data.max_seq_len=99999999999999999999", "data.max_seq_len"),  # was OverflowError in packing, exit 4
    (f"data.max_seq_len={MAX_ROW_TOKENS + 1}", "data.max_seq_len"),
    ("data.tokens_per_batch=99999999999999999999", "data.tokens_per_batch"),
])
def test_a_row_past_the_token_bound_exits_2_before_any_model_loads(override, key, capsys):
    assert main(["train", override]) == 2
    err = capsys.readouterr().err
    assert f"config {key}=" in err and f"{MAX_ROW_TOKENS}]" in err and "Traceback" not in err, err


def test_date_like_tagged_and_deep_values_are_config_errors_not_bare_or_internal(tmp_path, capsys):
    """YAML 1.1 read 2024-02-30 as a date that does not exist ('day is out of range for month', naming no key), a
    !!float tag on text raised a bare ValueError, and nesting past the recursion limit was an internal error (exit
    4). Date-like text is text (a string key takes it as written); the rest names the file or the key."""
    from chronicals.config import load_config

    assert load_config(None, ["train.out_dir=2024-02-30"]).train.out_dir == "2024-02-30"
    assert load_config(None, ["data.system_prompt=2024-13-01"]).data.system_prompt == "2024-13-01"
    (tmp_path / "d.yaml").write_text("train:\n  out_dir: 2024-02-28\n")  # was a datetime.date, then refused
    assert load_config(tmp_path / "d.yaml").train.out_dir == "2024-02-28"
    with pytest.raises(ValueError, match=r"optim.lr='2024-01-01' is invalid: expected a number"):
        load_config(None, ["optim.lr=2024-01-01"])
    (tmp_path / "t.yaml").write_text("optim:\n  lr: !!float abc\n")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 't.yaml'}: invalid YAML: a value cannot be read \(could "
                                         r"not convert string to float: 'abc'\)"):
        load_config(tmp_path / "t.yaml")
    (tmp_path / "deep.yaml").write_text("optim:\n  lr: " + "[" * 2000 + "]" * 2000 + "\n")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'deep.yaml'}: invalid YAML: nested too deeply"):
        load_config(tmp_path / "deep.yaml")
    assert main(["train", "optim.lr=" + "[" * 2000 + "]" * 2000]) == 2
    assert "config optim.lr=" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [("010", 10), ("0100", 100), ("1:30", None), ("1:20:00", None),
                                            ("0x10", 16), ("1_000", 1000)])
def test_yaml_1_1_octal_and_base_60_ints_are_not_read(text, expected, tmp_path):
    """save_every: 010 was 8 (octal) and max_steps: 1:30 was 90 (base 60), in a file and on the command line;
    010 is ten now and 1:30 an error naming the key."""
    path = tmp_path / "c.yaml"
    path.write_text(f"train:\n  save_every: {text}\n")
    for load in (lambda: load_config(str(path)), lambda: load_config(None, [f"train.save_every={text}"])):
        if expected is None:
            with pytest.raises(ValueError, match=r"train.save_every='1:[0-9:]+' is invalid: expected an integer"):
                load()
        else:
            assert load().train.save_every == expected


def test_a_config_of_nested_aliases_is_refused_in_a_short_message(tmp_path, capsys):
    """498 bytes of YAML aliases ("billion laughs") are a list of 10^9 items; the error's full repr of it ran out
    of memory (exit 4). The value is shown cut to a readable size."""
    rows = ["&l0 [x, x, x, x, x, x, x, x, x, x]"] + [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]"
                                                     for i in range(1, 9)]
    path = tmp_path / "laughs.yaml"
    path.write_text("optim:\n  lr: [" + ", ".join(rows) + "]\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: config optim.lr=[[" in err and "is invalid: expected a number" in err and len(err) < 2000


def test_a_long_flat_list_given_for_a_number_is_shown_cut_in_its_error(tmp_path):
    """A 5,000-item list where a number belongs is shown as its first items and "...", not whole: nesting alone is
    cut by the depth limit, a flat list only by the item limit."""
    path = tmp_path / "long.yaml"
    path.write_text("optim:\n  lr: [" + ", ".join(["1"] * 5000) + "]\n")
    with pytest.raises(ValueError) as e:
        load_config(str(path))
    msg = str(e.value)
    assert "config optim.lr=[1, 1, 1, 1, 1, 1, 1, 1, ...] is invalid: expected a number" in msg, msg[:300]


@pytest.mark.parametrize("key", ["data.format", "model.dtype"])
def test_a_long_bad_string_is_shown_cut_in_its_error(key):
    """A pasted 5000-character value is shown cut (to about 200 characters) in the error, and what is expected still
    follows it; shown in full, it flooded the one error line."""
    with pytest.raises(ValueError) as e:
        load_config(None, [f"{key}=" + "x" * 5000])
    msg = str(e.value)
    assert msg.startswith(f"command line: config {key}='xxx") and "..." in msg and "is invalid: expected" in msg
    assert len(msg) < 600, len(msg)


def test_negative_epochs_are_refused_beside_max_steps_too():
    with pytest.raises(ValueError, match=r"train.epochs=-5.0 is invalid: expected a number > 0 \(0 only beside"):
        load_config(None, ["train.max_steps=1", "train.epochs=-5"])
    assert load_config(None, ["train.max_steps=1", "train.epochs=0"]).train.max_steps == 1


def test_zero_epochs_without_max_steps_are_refused():
    """train.epochs=0 is taken only beside train.max_steps > 0: alone (max_steps=0, the default) it is a run that
    trains nothing, refused when read with the hint to set max_steps (dropping the max_steps condition passed it)."""
    for overrides in (["train.epochs=0"], ["train.epochs=0", "train.max_steps=0"]):
        with pytest.raises(ValueError, match=r"^command line: config train\.epochs=0\.0 is invalid: expected a number "
                                             r"> 0, or set train\.max_steps > 0$"):
            load_config(None, overrides)


@pytest.mark.skipif(not __import__("os").path.isdir("/dev/fd"), reason="needs /dev/fd for a pipe's path")
def test_a_config_through_a_pipe_is_read(capsys):
    """`chronicals train <(...)` was refused ("a config file must end in .yaml"), though load_config reads pipes."""
    import os

    read, write = os.pipe()
    os.write(write, b"optim:\n  lr: x\n")
    os.close(write)
    try:
        assert main(["train", f"/dev/fd/{read}"]) == 2
    finally:
        os.close(read)
    assert f"/dev/fd/{read}:2: config optim.lr='x' is invalid: expected a number" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs /proc, where no folder can be made")
def test_an_out_dir_that_cannot_be_created_is_named(capsys):
    """A bare "[Errno 2] No such file or directory: '/proc/x'" named no setting."""
    assert main(["train", "train.out_dir=/proc/chronicals-run", "train.max_steps=1", "eval.qa=false"]) == 3
    err = capsys.readouterr().err
    assert "train.out_dir=/proc/chronicals-run: cannot create it (" in err and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["11", "3.5e37", "1e300"])
def test_a_learning_rate_no_adamw_can_take_is_a_config_error(value):
    """optim.lr >= 3.4e37 overflowed inside AdamW's step (lr / (1 - beta1) past float32's max: a RuntimeError at the
    first update, exit 4); smaller absurd ones diverged at step 2. Refused when the config is read."""
    with pytest.raises(ValueError, match=r"optim\.lr=.* is invalid: expected a number in \(0, 10\]"):
        load_config(None, [f"optim.lr={value}"])
    assert load_config(None, ["optim.lr=10"]).optim.lr == 10.0


def test_an_override_stays_an_override_even_where_a_file_of_its_name_exists(tmp_path, monkeypatch):
    """`data.path=x.yaml` sets data.path although a file named "data.path=x.yaml" exists in the working directory
    (an existing .yaml file with '=' in its name is otherwise the config, as runs/lr=3e-4/x.yaml is): its text before
    the '=' names a key section. Taken for the config, the file's contents replaced the user's override."""
    import chronicals.config as config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.path=x.yaml").write_text("optim:\n  lr: 0.5\n")
    (tmp_path / "lr=3e-4.yaml").write_text("optim:\n  lr: 0.5\n")
    seen = []

    def load(path, overrides):
        seen.append((path, list(overrides)))
        raise ValueError("stop here")

    monkeypatch.setattr(config, "load_config", load)
    assert main(["train", "data.path=x.yaml"]) == 2
    assert main(["train", "lr=3e-4.yaml"]) == 2  # no key section before the '=': the existing file is the config
    assert seen == [(None, ["data.path=x.yaml"]), ("lr=3e-4.yaml", [])], seen


def test_a_config_files_errors_are_config_errors_as_a_dicts_are(tmp_path):
    """A YAML file's bad value came as a plain ValueError and a dict's as a ConfigError: a script catching ConfigError
    (what train()'s docstring names) caught the one and not the other (an API walk)."""
    from chronicals.config import ConfigError, from_dict, load_config

    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  max_seq_len: lots\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2: config data.max_seq_len='lots' is invalid") as e:
        load_config(f)
    assert e.value.key == "data.max_seq_len"
    with pytest.raises(ConfigError, match="command line: unknown config key"):
        load_config(f, ["train.max_stepz=3"])
    with pytest.raises(ConfigError):
        from_dict({"data": {"max_seq_len": "lots"}})
