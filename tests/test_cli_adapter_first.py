"""Every command that takes ``--adapter`` (chat, generate, export, export --no-merge, as eval) refuses an adapter
that does not fit its base before the base weights load (seconds for the embedded model, minutes at 8B), with the
words and exit status eval gives for it: a PEFT adapter whose adapter_config.json or weights file is bad, or that was
saved from a model of another width (same module names), or a LoRA run's checkpoint on a base of other modules or
sizes. The weights loader raises here if it is called, so a refusal that comes after the load fails the test."""

from __future__ import annotations

import json

import pytest

from chronicals.cli import main
from test_cli_checkpoints import run  # noqa: F401 (fixture: a 2-step LoRA run on tiny_base)
from test_cli_eval import data_file, tiny_base  # noqa: F401 (fixtures)
from test_cli_eval_hostile import BAD_ADAPTERS, MISFITS, _adapter, _other_models_adapter

COMMANDS = {  # the command line, given --base BASE --adapter ADAPTER and a folder for export's --out
    "chat": lambda given, out: ["chat", *given, "--device", "cpu", "Who founded Vellmora?"],
    "generate": lambda given, out: ["generate", *given, "--device", "cpu", "Who founded Vellmora?"],
    "export": lambda given, out: ["export", *given, "--out", out / "merged"],
    "export --no-merge": lambda given, out: ["export", *given, "--no-merge", "--out", out / "peft"],
}


def _other_base(tiny_base, out, **sizes):
    """A model directory of tiny_base's config with ``sizes`` changed (and its tokenizer)."""
    import transformers

    from chronicals import load_tokenizer, save_model
    from chronicals.models import CausalLM, ModelConfig

    conf = json.loads((tiny_base / "config.json").read_text())
    hf = transformers.LlamaConfig(**{**conf, **sizes})
    return save_model(CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0),
                      load_tokenizer(tiny_base), out)


def _bad_adapter(case, tiny_base, run, tmp_path):  # noqa: F811 (run, tiny_base: fixtures)
    """(the base to pass, the bad adapter, words of its refusal) of ``case``."""
    if case in MISFITS:  # a PEFT adapter of a model of other sizes (same module names), its tensors edited
        opts, edit, said = MISFITS[case]
        return tiny_base, _other_models_adapter(tiny_base, tmp_path / "adapter", edit, **opts), said
    if case in ADAPTER_FIELDS:  # a PEFT adapter of tiny_base, its adapter_config.json or weights file bad
        fields, remove, said = ADAPTER_FIELDS[case]
        return tiny_base, _adapter(tiny_base, tmp_path / "adapter", remove, **fields), said
    sizes, said = CHECKPOINT_BASES[case]  # the run trained tiny_base: 2 layers, MLP width 48
    return _other_base(tiny_base, tmp_path / "other", **sizes), run / "checkpoints" / "step-000002", said


# (use_dora and the like are refused where the base is looked up, adapter_config.json read before any load)
ADAPTER_FIELDS = {"no_target": BAD_ADAPTERS[0], "no_weights": BAD_ADAPTERS[4]}
CHECKPOINT_BASES = {  # (the base's sizes, words of apply_checkpoint_adapter's refusal)
    "checkpoint_modules": (dict(num_hidden_layers=3), "does not fit this base: its LoRA targets match other modules "
                                                      "here (e.g. model.layers.2."),
    "checkpoint_shapes": (dict(intermediate_size=64), "does not fit this base ("),
}
CASES = ["missing_key", "out_features", "in_features", *ADAPTER_FIELDS, "checkpoint_modules", "checkpoint_shapes"]


def _without_the_weights(args, monkeypatch, capsys) -> tuple[int, str]:
    """(exit status, stderr) of ``chronicals ARGS``, which must not have read the base's weights."""
    import chronicals.models.loading as loading

    loads = []
    monkeypatch.setattr(loading, "load_hf_dir", lambda *a, **k: loads.append(a) or 1 / 0)
    capsys.readouterr()
    try:
        rc = main([str(x) for x in args])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert not loads, f"chronicals {args[0]} loaded the base weights before refusing the adapter: {err}"
    return rc, err


def _error(err: str) -> str:
    """The one ``error:`` line of a command's stderr."""
    said = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(said) == 1, err
    return said[0]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_is_refused_as_eval_refuses_it_before_the_weights_load(command, case, tiny_base, data_file,
                                                                             run, tmp_path, monkeypatch, capsys):
    """chat, generate and export loaded the base weights, then refused the adapter (load_adapter's or
    apply_checkpoint_adapter's refusal, exit 3); eval checked it on the decoder built on the meta device before.
    Each refuses it so now, in eval's words and with eval's exit status, and writes nothing."""
    base, adapter, said = _bad_adapter(case, tiny_base, run, tmp_path)
    given = ["--base", base, "--adapter", adapter]
    eval_rc, eval_err = _without_the_weights(["eval", *given, data_file, "--device", "cpu"], monkeypatch, capsys)
    assert eval_rc == 3 and said in _error(eval_err), eval_err
    rc, err = _without_the_weights(COMMANDS[command](given, tmp_path), monkeypatch, capsys)
    assert (rc, _error(err)) == (eval_rc, _error(eval_err)), err
    assert "Traceback" not in err and not (tmp_path / "merged").exists() and not (tmp_path / "peft").exists()
