"""``chronicals export`` of a LoRA adapter whose base is a GGUF file with partial rope: save_model refuses to write
the merged model (a Hugging Face directory would load as another model). The refusal is a message, exit status 3,
no traceback, and it says what works instead (the adapter as it is, with chat/eval --adapter); it named no way on."""

from __future__ import annotations

import gguf
import pytest

import chronicals
from chronicals.cli import main
from chronicals.lora import apply_lora, save_adapter
from test_gguf import _gguf_name
from test_gguf_hunt17 import _BPE_VOCAB, _bpe_tokenizer_metadata
from test_gguf_partial_rope import THETA, _hf_cfg, _random_stored

pytestmark = pytest.mark.usefixtures("one_thread")


def test_export_of_an_adapter_on_a_partial_rope_gguf_says_what_works(tmp_path, capsys):
    cfg = {**_hf_cfg("llama", 16, 8), "vocab_size": _BPE_VOCAB}
    path = tmp_path / "partial.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in [(w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 32),
                   (w.add_feed_forward_length, 40), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_key_length, 16), (w.add_value_length, 16), (w.add_rope_dimension_count, 8),
                   (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, THETA), (w.add_vocab_size, _BPE_VOCAB)]:
        add(v)
    _bpe_tokenizer_metadata(w)
    for name, t in _random_stored(cfg).items():
        w.add_tensor(_gguf_name(name), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model, _ = chronicals.load_model(path, tokenizer=False, impl="torch")
    apply_lora(model, r=4, alpha=8)
    adapter = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(path))
    capsys.readouterr()
    assert main(["export", "--adapter", str(adapter), "--out", str(tmp_path / "merged")]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and "rotates 8 of its head_dim=16" in err
    assert "--adapter" in err.split("rotates", 1)[1], err  # the way on: the adapter with chat/eval --adapter
    assert not (tmp_path / "merged").exists()
