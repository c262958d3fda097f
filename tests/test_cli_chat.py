"""``chronicals chat``: the system message it asks with (the demo's without --system, a full run's own for its
model/), the sampling options reaching each answer, and prompts given on the command line at a terminal. The model
and the answers are faked: what is checked is what chat passes on."""

from __future__ import annotations

import io
import types

import pytest
import torch

from chronicals import cli_chat
from chronicals.config import DEMO_SYSTEM_PROMPT, from_dict


def _fake(monkeypatch, answer, positions=4096) -> None:
    """chat's load and its prompt ids faked; ``answer`` stands for qa.answer; the model attends to ``positions``."""
    import chronicals.train.qa as qa

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=positions),
                                  lm_head=types.SimpleNamespace(weight=torch.zeros(1)))
    tok = types.SimpleNamespace(chat_template="{{ x }}")
    monkeypatch.setattr(cli_chat, "_load", lambda *a, **k: (model, tok))
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1, 2, 3])
    monkeypatch.setattr(qa, "answer", answer)


class _Tty(io.StringIO):
    """stdin at a terminal: its input is the given text, then Ctrl-D."""
    def isatty(self):
        return True


def test_chat_without_system_uses_the_demo_system_prompt(monkeypatch, capsys):
    seen = []
    _fake(monkeypatch, lambda m, t, q, system, *a, **k: seen.append(system) or "ok")
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "hi"]) == 0
    assert seen == [DEMO_SYSTEM_PROMPT]
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "--system", "", "hi"]) == 0
    assert seen[-1] == ""  # given, as given
    assert "> hi\nok" in capsys.readouterr().out


def test_chat_with_a_full_runs_model_asks_with_that_runs_system_message(tmp_path, monkeypatch):
    """--model runs/x/model (a full fine-tuning run's output) without --system asks with the system message of that
    run's held-out prompts (its config.yaml beside model/), as --help says, not the demo's."""
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    cfg = from_dict({"data": {"path": "chats.jsonl", "system_prompt": "Be terse."}})
    (run / "config.yaml").write_text(cfg.to_yaml())
    seen = []
    _fake(monkeypatch, lambda m, t, q, system, *a, **k: seen.append(system) or "ok")
    assert cli_chat.cmd_chat(["--model", str(run / "model"), "--device", "cpu", "hi"]) == 0
    assert seen == ["Be terse."]


def test_chat_passes_temperature_top_p_and_the_seeded_generator_to_each_answer(monkeypatch):
    """--top-p reaches the answer (the sampling test compares seed 1 with seed 2, which differ whatever top-p does),
    with --temperature, --max-new-tokens and a generator seeded by --seed."""
    seen = []

    def answer(m, t, q, system, room, temperature, top_p, generator, history, streamer):
        seen.append((room, temperature, top_p, generator.initial_seed()))
        return "ok"

    _fake(monkeypatch, answer)
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "--temperature", "0.7", "--top-p", "0.9",
                              "--seed", "5", "--max-new-tokens", "7", "hi"]) == 0
    assert seen == [(7, 0.7, 0.9, 5)]


def test_max_new_tokens_may_be_the_whole_context_but_not_more(monkeypatch, capsys):
    """--max-new-tokens is checked against the model's max_position_embeddings: exactly the context is allowed (the
    refusal itself says "use at most {context}"), one more exits 2 before any prompt is answered. A `>=` at that
    edge refused the very value the message advises."""
    rooms = []
    _fake(monkeypatch, lambda m, t, q, system, room, *a, **k: rooms.append(room) or "ok", positions=64)
    argv = ["--model", "some-model", "--device", "cpu", "hi", "--max-new-tokens"]
    assert cli_chat.cmd_chat([*argv, "64"]) == 0
    assert rooms == [61]  # the prompt's 3 tokens share the 64
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli_chat.cmd_chat([*argv, "65"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--max-new-tokens 65 is more than some-model can attend to" in err, err
    assert "use at most 64" in err and rooms == [61], err


def test_prompts_given_in_a_terminal_are_answered_not_replaced_by_typed_ones(monkeypatch, capsys):
    """`chronicals chat "Who founded Vellmora?"` typed at a terminal (stdin a tty) answers that prompt, labelled, and
    exits: the other tests' stdin is no tty, so a check on the tty alone passed them while a user's own prompt was
    ignored and chat sat waiting for typed lines."""
    seen = []
    monkeypatch.setattr("sys.stdin", _Tty(""))
    _fake(monkeypatch, lambda m, t, q, system, room, temp, top_p, gen, history, streamer:
          seen.append((q, list(history), streamer)) or "ok")
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "hi", "again"]) == 0
    assert seen == [("hi", [], None), ("again", [], None)]  # each on its own (--turns auto), not streamed
    out, err = capsys.readouterr()
    assert out == "> hi\nok\n> again\nok\n" and "type a message" not in err


def test_ctrl_d_at_once_in_a_terminal_exits_0_quietly(monkeypatch, capsys):
    """At a terminal, Ctrl-D before any message ends chat quietly with exit 0: the user chose to leave. "no prompt",
    exit 2, is for piped stdin holding no line (a script's mistake); taken for that at a terminal too, leaving
    chat without a word typed was an error."""
    _fake(monkeypatch, lambda *a, **k: 1 / 0)  # nothing is asked
    monkeypatch.setattr("transformers.TextStreamer", lambda *a, **k: None)
    monkeypatch.setattr("sys.stdin", _Tty(""))
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "error" not in err and "type a message" in err, err


def test_reset_is_an_ordinary_prompt_where_each_prompt_is_asked_alone(monkeypatch, capsys):
    """'/reset' forgets the conversation under --turns multi only; where each prompt is asked on its own (--turns
    single, and given or piped prompts by default) there is nothing to forget and it is answered like any other
    prompt. Taken as the command there too, it was dropped without a word (alone: "no prompt", exit 2)."""
    seen = []
    _fake(monkeypatch, lambda m, t, q, system, *a, **k: seen.append(q) or "ok")
    for turns in (["--turns", "single"], []):
        assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", *turns, "/reset", "hi"]) == 0
        out, err = capsys.readouterr()
        assert out == "> /reset\nok\n> hi\nok\n" and "starts over" not in err, (out, err)
    assert seen == ["/reset", "hi"] * 2


def test_a_prompt_that_exactly_fills_the_context_is_told_to_shorten_by_one_token(monkeypatch, capsys):
    """The templated prompt and its answer share the model's context: a prompt of exactly the context's tokens
    leaves no room and is refused (exit 3) with "shorten it by at least 1 token"; a context one token longer
    answers it in 1 token, with a note. At that edge a prompt taken to fit was refused as "leaves room for 0", a
    --max-new-tokens note that says nothing of what to cut."""
    import chronicals.train.qa as qa

    rooms = []
    prompt = "w w w w"  # 4 tokens + 2 of framing (system message and template): 6
    for positions in (6, 7):
        _fake(monkeypatch, lambda m, t, q, system, room, *a, **k: rooms.append(room) or "ok", positions)
        monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1] * (2 + len(q.split())))
        rc = cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "--max-new-tokens", "2", prompt])
        err = capsys.readouterr().err
        if positions == 6:
            assert rc == 3 and "no room for an answer; shorten it by at least 1 token" in err, err
            assert "leaves room" not in err and rooms == [], err
        else:
            assert rc == 0 and "leaves room for 1 in the 7 tokens" in err and rooms == [1], err


def test_a_run_config_that_cannot_be_read_leaves_the_system_message_to_the_default(tmp_path, monkeypatch, capsys):
    """A config.yaml beside the adapter that cannot be read (permissions, a network share gone) is not chat's to
    fail on: no run system message is taken, and chat asks with the default (an OSError had ended chat before any
    prompt; a mutation walk)."""
    import chronicals.config

    d = tmp_path / "run"
    (d / "adapter").mkdir(parents=True)
    (d / "config.yaml").write_text("data: {path: demo}\n")

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied", str(d / "config.yaml"))

    monkeypatch.setattr(chronicals.config, "load_config", unreadable)
    assert cli_chat._run_system_prompt(str(d / "adapter")) is None
    assert capsys.readouterr().err == ""


def test_seed_takes_the_whole_generator_range_and_nothing_past_it(monkeypatch, capsys):
    """--seed in [-2**63, 2**64), torch.Generator.manual_seed's range: both ends reach the generator (2**64 - 1 was
    refused by a bound of 2**63; a mutation walk), one past either end exits 2 before the model loads."""
    seeds = []
    _fake(monkeypatch, lambda m, t, q, system, room, temperature, top_p, generator, *a: seeds.append(
        generator.initial_seed()) or "ok")
    argv = ["--model", "some-model", "--device", "cpu", "--temperature", "1", "hi", "--seed"]
    for seed, seen in ((2**64 - 1, 2**64 - 1), (-2**63, 2**63)):  # a negative seed wraps, as torch takes it
        assert cli_chat.cmd_chat([*argv, str(seed)]) == 0
        assert seeds.pop() == seen
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(SystemExit) as e:
            cli_chat.cmd_chat([*argv, str(seed)])
        assert e.value.code == 2 and f"--seed {seed} must be in [-2**63, 2**64)" in capsys.readouterr().err


def test_typed_lines_are_stripped_so_blank_ones_are_skipped_and_a_spaced_reset_resets(monkeypatch, capsys):
    """At a terminal each typed line is taken without its surrounding spaces: a line of spaces is no prompt, and
    " /reset " forgets the conversation (kept as typed, both were asked as prompts; a mutation walk)."""
    seen = []
    monkeypatch.setattr("transformers.TextStreamer", lambda *a, **k: None)
    monkeypatch.setattr("sys.stdin", _Tty("  hello  \n   \n /reset \nagain\n"))
    _fake(monkeypatch, lambda m, t, q, system, room, temp, top_p, gen, history, streamer:
          seen.append((q, [said for said, _ in history])) or "ok")
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu"]) == 0
    assert seen == [("hello", []), ("again", [])], seen
    assert "(the conversation starts over)" in capsys.readouterr().err


def test_sampling_without_a_seed_draws_a_fresh_one_each_run(monkeypatch):
    """--temperature without --seed: each run's generator starts from a fresh seed, so two runs answer differently
    (left unseeded, torch's generator starts from its fixed default seed and every run gave the same answers)."""
    seeds = []
    _fake(monkeypatch, lambda m, t, q, system, room, temperature, top_p, generator, *a: seeds.append(
        generator.initial_seed()) or "ok")
    for _ in range(2):
        assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "--temperature", "1", "hi"]) == 0
    assert len(set(seeds)) == 2 and torch.Generator().initial_seed() not in seeds, seeds


@pytest.mark.parametrize("system_len, q_len, fix", [
    (64, 2, "the system message and template alone fill it: give a shorter --system"),
    (32, 40, "shorten it by at least 9 tokens or give a shorter --system"),
    (31, 40, "shorten it by at least 8 tokens"),
    (31, 34, "shorten it by at least 2 tokens"),
    (31, 33, "shorten it by at least 1 token"),
])
def test_a_prompt_past_the_context_is_told_what_to_cut(system_len, q_len, fix, monkeypatch):
    """A 64-token context, a template of one token per character: a system message that fills it alone is the
    thing to shorten; one of half the context or more is named beside the prompt; a shorter one is not (the bounds
    at exactly 64 and exactly 32 were each one off in a mutation walk)."""
    import chronicals.train.qa as qa

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=64))
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1] * (len(system) + len(q)))
    room, why = cli_chat._answer_room(model, None, "q" * q_len, "s" * system_len, 8, "tiny")
    assert room == 0 and why.endswith(f"no room for an answer; {fix}"), why
    assert f"the prompt {'q' * q_len!r} takes {system_len + q_len} tokens ({system_len} of them" in why, why


def test_a_long_prompt_is_shown_cut_at_sixty_characters(monkeypatch):
    """Up to 60 characters the refused prompt is shown whole; a longer one as its first 57 and "...", 60 in all."""
    import chronicals.train.qa as qa

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=8))
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1] * len(q))
    q60, q61 = "".join(str(i % 10) for i in range(60)), "".join(str(i % 10) for i in range(61))
    assert cli_chat._answer_room(model, None, q60, "", 4, "tiny")[1].startswith(f"the prompt {q60!r} takes 60 ")
    assert cli_chat._answer_room(model, None, q61, "", 4, "tiny")[1].startswith(
        f"the prompt {q61[:57] + '...'!r} takes 61 ")


def test_the_cap_note_names_earlier_turns_when_there_are_some(monkeypatch):
    """An answer cut short by the context: the note counts what shares it, the earlier turns when there are any."""
    import chronicals.train.qa as qa

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=16))
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1] * (len(q) + 4 * len(history)))
    room, why = cli_chat._answer_room(model, None, "q" * 6, "", 8, "tiny", [("a", "b")])
    assert room == 6 and "a prompt of 10 tokens (with the system message, earlier turns and chat template) leaves " \
        "room for 6 in the 16 tokens tiny attends to (max_position_embeddings)" in why, why
    room, why = cli_chat._answer_room(model, None, "q" * 10, "", 8, "tiny")
    assert room == 6 and "a prompt of 10 tokens (with the system message and chat template) leaves room" in why, why


def test_a_typed_line_that_is_not_utf8_is_named_as_typed(monkeypatch, capsys):
    """At a terminal a line that is not UTF-8 is "the typed line" (a piped one is "stdin line"), shown with U+FFFD for
    the bad byte; the next line is answered and the exit status is 3 (bad input)."""
    seen = []
    monkeypatch.setattr("transformers.TextStreamer", lambda *a, **k: None)
    monkeypatch.setattr("sys.stdin", _Tty("ok\udcff\nfine\n"))
    _fake(monkeypatch, lambda m, t, q, *a: seen.append(q) or "ok")
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu"]) == 3
    assert seen == ["fine"]
    assert "error: the typed line 'ok\ufffd' is not valid UTF-8 (byte 0xff at character 2)" in capsys.readouterr().err


# Mistral-7B-Instruct v0.1/v0.2's template (a supported model type): it refuses any system message
_NO_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def test_chat_with_a_template_that_takes_no_system_message(monkeypatch, capsys):
    """A chat template that refuses a system message (Mistral v0.1/v0.2's raise_exception) failed every prompt with
    jinja2's bare TemplateError, exit 4 "internal error" with a traceback, as chat asks with the demo's system
    message by default. Now the default one is left out (said), and a given --system exits 2 naming the fix."""
    from smollm2_tokenizer import smollm2_tokenizer

    tok = smollm2_tokenizer()
    tok.chat_template = _NO_SYSTEM_TEMPLATE
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096),
                                  lm_head=types.SimpleNamespace(weight=torch.zeros(1)))
    monkeypatch.setattr(cli_chat, "_load", lambda *a, **k: (model, tok))
    import chronicals.train.qa as qa

    seen = []

    def answer(m, t, q, system, *a, **k):
        qa.prompt_ids(t, q, system)  # renders, as the real answer does
        seen.append(system)
        return "ok"

    monkeypatch.setattr(qa, "answer", answer)
    assert cli_chat.cmd_chat(["--model", "mistral", "--device", "cpu", "hi"]) == 0
    assert seen == [""]
    captured = capsys.readouterr()
    assert "> hi\nok" in captured.out and "takes no system message" in captured.err
    assert "--system not given: using" not in captured.err  # the demo's message is not said to be used, then dropped
    with pytest.raises(SystemExit) as e:
        cli_chat.cmd_chat(["--model", "mistral", "--device", "cpu", "--system", "Be brief.", "hi"])
    assert e.value.code == 2
    assert "--system ''" in capsys.readouterr().err
    with pytest.raises(qa.TemplateRefused):  # a ValueError: the CLI's one "error:" line, exit 3
        qa.prompt_ids(tok, "hi", "Be brief.")
