"""``chronicals chat``: without --system it asks with the demo's system message, as its --help says."""

from __future__ import annotations

import types

from chronicals import cli_chat
from chronicals.config import DEMO_SYSTEM_PROMPT


def test_chat_without_system_uses_the_demo_system_prompt(monkeypatch, capsys):
    import chronicals.train.qa as qa

    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=4096))
    tok = types.SimpleNamespace(chat_template="{{ x }}")
    seen = []
    monkeypatch.setattr(cli_chat, "_load", lambda *a, **k: (model, tok))
    monkeypatch.setattr(qa, "prompt_ids", lambda tok, q, system, history=(): [1, 2, 3])
    monkeypatch.setattr(qa, "answer", lambda m, t, q, system, *a, **k: seen.append(system) or "ok")
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "hi"]) == 0
    assert seen == [DEMO_SYSTEM_PROMPT]
    assert cli_chat.cmd_chat(["--model", "some-model", "--device", "cpu", "--system", "", "hi"]) == 0
    assert seen[-1] == ""  # given, as given
    assert "> hi\nok" in capsys.readouterr().out
