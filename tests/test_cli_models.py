"""The helpers export / chat / eval share (cli_models): the console log's level for other libraries, the load's
dtype, mode and tokenizer, which --model a --base goes with, and how a bad byte is named. Gaps a mutation walk of
cli_models.py found (each test names the change it catches)."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from chronicals.cli_models import _load, _model_and_base, _not_utf8


def test_the_console_log_leaves_other_libraries_info_lines_out():
    """chronicals' own info lines are shown (rank 0), another library's are not: the root logger stays at WARNING
    (at INFO every info line of transformers, filelock, httpx ... reached a chat -v console)."""
    code = ("import logging\nfrom chronicals.cli_models import _setup_logging\n_setup_logging()\n"
            "logging.getLogger('chronicals.train').info('ours')\nlogging.getLogger('otherlib').info('theirs')\n"
            "logging.getLogger('otherlib').warning('their warning')\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    lines = [line.split(" ", 1)[1] for line in err.splitlines()]
    assert lines == ["chronicals.train: ours", "otherlib: warning: their warning"], err


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    """A tiny random Llama saved in bf16, without tokenizer files (as transformers' save_pretrained alone writes)."""
    from chronicals import save_model
    from chronicals.models import CausalLM, ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    model = CausalLM(cfg).init_weights(seed=0).to(torch.bfloat16)
    return save_model(model, None, tmp_path_factory.mktemp("bf16") / "base")


def test_load_takes_autos_dtype_and_the_checkpoints_own_on_request(bf16_base):
    """--dtype auto on the CPU is float32 (as train loads it), not the checkpoint's bf16; "checkpoint" (export's
    auto) keeps the bf16 as saved."""
    cpu = torch.device("cpu")
    model, _ = _load(str(bf16_base), None, cpu, "auto", tokenizer=False)
    assert model.lm_head.weight.dtype == torch.float32
    model, _ = _load(str(bf16_base), None, cpu, "checkpoint", tokenizer=False)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_load_returns_the_model_in_eval_mode_and_no_tokenizer_when_asked_for_none(bf16_base, tmp_path):
    """Eval mode in every module, the adapter's new ones too (a LoRA adapter's dropout 0.5 would otherwise drop
    activations in chat and eval: the load gives its layers in training mode); tokenizer=False loads none, so a
    model directory without tokenizer files loads (export's merge needs none)."""
    from chronicals import load_model
    from chronicals.lora import apply_lora, save_adapter

    model, _ = load_model(str(bf16_base), dtype=torch.float32, tokenizer=False)
    apply_lora(model, r=2, dropout=0.5, target_modules=["q_proj"])
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(bf16_base))
    model, tok = _load(str(bf16_base), str(tmp_path / "adapter"), torch.device("cpu"), "float32", tokenizer=False)
    assert tok is None
    assert not any(m.training for m in model.modules())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # and so its answers repeat
        assert torch.equal(model(ids), model(ids))


def test_a_pt_file_other_than_state_pt_given_with_base_is_no_checkpoint(tmp_path, capsys):
    """--model x/weights.pt --base M: not a run's checkpoint, so "leave --base out"; only a checkpoint's state.pt is
    answered with "pass its checkpoint directory" (any .pt file was taken for one)."""
    (tmp_path / "weights.pt").write_bytes(b"x")
    a = argparse.Namespace(model=str(tmp_path / "weights.pt"), base=str(tmp_path), adapter=None)
    with pytest.raises(SystemExit):
        _model_and_base(argparse.ArgumentParser(prog="chronicals chat"), a)
    err = capsys.readouterr().err
    assert "is not a run's checkpoint (runs/x/checkpoints/step-N), and --base is only for one: leave --base out" \
        in err, err


def test_a_run_of_bad_bytes_is_named_whole():
    """Two undecodable bytes in a row are one error: both named, at the first one's character."""
    assert _not_utf8("a\udcff\udcfeb") == "byte 0xff 0xfe at character 1"
    assert _not_utf8("ab\udcc3") == "byte 0xc3 at character 2"
    assert _not_utf8("añb") is None
