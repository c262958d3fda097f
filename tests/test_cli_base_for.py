"""Which base export / chat / eval put an adapter on (cli_models._base_for): a recorded base that is blank or no
string, one under ~, and the embedded model's name in another case."""
from __future__ import annotations

import json

import pytest

from chronicals.cli_models import EMBEDDED, _base_for


def _adapter(tmp_path, base):
    ad = tmp_path / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base, "peft_type": "LORA", "r": 2,
                                                        "lora_alpha": 4, "target_modules": ["q_proj"]}))
    return str(ad)


@pytest.mark.parametrize("recorded", ["", 5, ["org/model"]])
def test_a_blank_or_non_string_recorded_base_falls_back_to_the_embedded_model(recorded, tmp_path, capsys):
    """base_model_name_or_path "" (a hand-written or other tool's config) or not a string records no base: the
    embedded model with the line saying so. A blank one was taken as the base "" (the current directory, which
    exists: "using , the base recorded in ...", then a load error); a number raised a TypeError traceback."""
    ad = _adapter(tmp_path, recorded)
    assert _base_for(ad, None, "--base") == EMBEDDED
    assert f"{ad}/adapter_config.json records no base model: using {EMBEDDED}" in capsys.readouterr().err


def test_a_home_relative_recorded_base_is_found(tmp_path, monkeypatch, capsys):
    """A recorded base "~/base" (an older run's model.path, another tool's adapter_config.json) is the directory
    under $HOME: taken, not refused as "which is not here"; and a given base that is that directory is no other
    model, so nothing warns."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "base").mkdir()
    ad = _adapter(tmp_path, "~/base")
    assert _base_for(ad, None, "--base") == "~/base"
    assert f"--base not given: using ~/base, the base recorded in {ad}/adapter_config.json" in capsys.readouterr().err
    assert _base_for(ad, str(tmp_path / "base"), "--base") == str(tmp_path / "base")
    assert "warning" not in capsys.readouterr().err


def test_the_embedded_models_name_in_any_case_is_here(tmp_path, capsys):
    """load_model (and so train's model.path) takes the embedded model's name in any case ("SmolLM2-135M-Instruct",
    as the README writes it) and the run records it as given: export / chat / eval of its adapter refused it as
    "which is not here". A --base of the name in another case is the same model: no warning."""
    ad = _adapter(tmp_path, "SmolLM2-135M-Instruct")
    assert _base_for(ad, None, "--base") == "SmolLM2-135M-Instruct"
    capsys.readouterr()
    assert _base_for(ad, EMBEDDED, "--base") == EMBEDDED
    assert "warning" not in capsys.readouterr().err


def test_a_base_given_for_an_adapter_whose_recorded_base_is_gone_is_taken_without_a_warning(tmp_path, capsys):
    """The recorded base is not here (the adapter came from another machine): without a base the refusal says to
    pass one, and the one then passed is taken without a warning; there is nothing here to compare it with, and a
    warning on the very step the refusal advises would be noise (a mutation walk)."""
    ad = _adapter(tmp_path, str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match="which is not here; pass --base with that model's directory"):
        _base_for(ad, None, "--base")
    (tmp_path / "copy").mkdir()
    assert _base_for(ad, str(tmp_path / "copy"), "--base") == str(tmp_path / "copy")
    assert capsys.readouterr().err == ""
