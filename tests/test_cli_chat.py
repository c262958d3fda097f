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
    leaves no room and is refused (exit 3) with "shorten it by at least 1 tokens"; a context one token longer
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
            assert rc == 3 and "no room for an answer; shorten it by at least 1 tokens" in err, err
            assert "leaves room" not in err and rooms == [], err
        else:
            assert rc == 0 and "leaves room for 1 in the 7 tokens" in err and rooms == [1], err
