"""GGUF with partial rope (``rope.dimension_count`` n_rot < head_dim D), checked against llama.cpp's semantics
written out here, not against gguf_io's layout.

llama.cpp rotates each head's rows as the file stores them: for ``llama`` (rope mode NORM, GPT-J) the adjacent
pairs (2i, 2i + 1), 2i < n_rot; for ``qwen2`` (mode NEOX) the pairs (i, i + n_rot/2), i < n_rot/2; pair i by
position * theta^(-2i/n_rot) in both; rows n_rot..D-1 pass through. The files here hold random tensors in that
stored layout. Attention scores q.k are unchanged by a permutation applied to the dims of both q and k, so
comparing scores (per head, per query and key position) tests the rotation without assuming where the
converter put each row.
"""

from __future__ import annotations

import json
import math

import gguf
import pytest
import torch
from safetensors.torch import load_file

import chronicals
from chronicals.cli import main
from chronicals.lora import apply_lora, save_adapter
from chronicals.models import CausalLM, ModelConfig, gguf_cache, gguf_io
from chronicals.models.gguf_io import permute_qk, unpermute_qk
from chronicals.ops import rope_cos_sin, rope_qk
from test_gguf import _gguf_name  # llama.cpp's tensor names, apart from gguf_io's own table
from test_gguf_metadata import _BPE_VOCAB, _bpe_tokenizer_metadata

pytestmark = pytest.mark.usefixtures("one_thread")

THETA = 10000.0
POSITIONS = [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89]  # per-token positions, as llama.cpp takes them


def _hf_cfg(arch: str, head_dim: int, n_rot: int) -> dict:
    """A tiny config: 4 query heads over 2 kv heads (GQA), head_dim not hidden / heads, q/k biases."""
    cfg = dict(model_type=arch, vocab_size=97, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-6,
               rope_theta=THETA, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2)
    if arch == "llama":
        cfg["attention_bias"] = True  # bias rows are permuted like weight rows
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    if n_rot != head_dim:  # rotary_dim = int(head_dim * factor): 30 / 44 gives 29, one ulp more gives 30
        f = n_rot / head_dim
        cfg["partial_rotary_factor"] = f if int(head_dim * f) == n_rot else math.nextafter(f, 1.0)
    assert ModelConfig.from_hf_dict(cfg).rotary_dim == n_rot
    return cfg


def _write(path, arch: str, cfg: dict, n_rot: int, stored: dict[str, torch.Tensor]) -> None:
    """``stored`` (HF names -> tensors as the file holds them) as F32 tensors with llama.cpp's metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(n_rot)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(THETA)
    w.add_vocab_size(cfg["vocab_size"])
    for name, t in stored.items():
        w.add_tensor(_gguf_name(name), t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_stored(cfg: dict) -> dict[str, torch.Tensor]:
    """Random tensors of every parameter the config implies (norm weights near 1), taken as the file's rows."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(ModelConfig.from_hf_dict(cfg)).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    return {k: 0.3 * torch.randn(s, generator=g) + (1.0 if k.endswith("norm.weight") else 0.0)
            for k, s in shapes.items()}


def _converted(path, tmp_path) -> CausalLM:
    """The model that ``convert_gguf``'s directory of ``path`` holds (config.json read by from_hf_dict), torch ops.

    (``load_model`` reads the same directory through the conversion cache:
    ``test_load_model_reads_a_partial_rope_gguf``.)"""
    out = gguf_io.convert_gguf(path, tmp_path / f"{path.stem}-hf")
    cfg = ModelConfig.from_hf_dict(json.loads((out / "config.json").read_text()), source=str(out))
    model = CausalLM(cfg, impl="torch")
    model.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    return model.eval()


def _llama_cpp_rotate(x: torch.Tensor, pos: torch.Tensor, n_rot: int, mode: str) -> torch.Tensor:
    """x (S, H, D) float64 in the file's row order, pos (S,) -> x rotated as llama.cpp's rope ``mode`` does."""
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    ang = pos.double()[:, None, None] * THETA ** (-2 * i / n_rot)  # (S, 1, n_rot/2)
    c, s = ang.cos(), ang.sin()
    out = x.clone()
    a, b = ((slice(0, n_rot, 2), slice(1, n_rot, 2)) if mode == "norm"  # adjacent pairs (2i, 2i + 1)
            else (slice(0, n_rot // 2), slice(n_rot // 2, n_rot)))  # neox: pairs (i, i + n_rot/2)
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (S, Hq, D), k (S, Hk, D) -> q.k (Hq, S, S), query head h against kv head h // (Hq / Hk)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("shd,thd->hst", q.double(), k.double())


@pytest.mark.parametrize("arch,head_dim,n_rot", [
    ("llama", 16, 8),   # the bug: the full-head un-permutation paired stored rows (2i, 2i+1) as dims (i, i+8)
    ("llama", 16, 16),  # control: full rope
    ("llama", 44, 30),  # 30 / 44 * 44 = 29.999...: the factor must give back rotary_dim 30, not int() 29
    ("llama", 5, 4),    # odd head_dim, even rotary rows: was refused as "rows do not split into rotary pairs"
    ("qwen2", 16, 8),   # not permuted; llama.cpp's NEOX mode is our partial rotary as it is
])
def test_attention_scores_match_llama_cpp_rope(tmp_path, arch, head_dim, n_rot):
    """Layer 0's q.k after rope, ours (converted model, chronicals.ops rope) vs llama.cpp's (from the file's rows).
    Before the fix llama 16/8 was off by 1.02 of the largest score and 44/30 loaded with rotary_dim 29; the
    control and qwen2 passed."""
    cfg = _hf_cfg(arch, head_dim, n_rot)
    stored = _random_stored(cfg)
    path = tmp_path / f"{arch}-{head_dim}-{n_rot}.gguf"
    _write(path, arch, cfg, n_rot, stored)
    model = _converted(path, tmp_path)
    assert model.config.rotary_dim == n_rot

    x = torch.randn(len(POSITIONS), cfg["hidden_size"], generator=torch.Generator().manual_seed(1))
    pos = torch.tensor(POSITIONS)
    nq, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim

    def proj(name, heads):  # from the file's rows, in float64: (S, heads, D)
        w, b = stored[f"model.layers.0.self_attn.{name}.weight"], stored.get(f"model.layers.0.self_attn.{name}.bias")
        y = x.double() @ w.double().T + (0 if b is None else b.double())
        return y.view(len(pos), heads, d)

    mode = "norm" if arch == "llama" else "neox"
    ref = _scores(_llama_cpp_rotate(proj("q_proj", nq), pos, n_rot, mode),
                  _llama_cpp_rotate(proj("k_proj", nkv), pos, n_rot, mode))

    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        q, k = attn.q_proj(x).view(1, len(pos), nq, d), attn.k_proj(x).view(1, len(pos), nkv, d)
        cos, sin = rope_cos_sin(pos[None], model.model.inv_freq, model.model.attention_scaling)
        q, k = rope_qk(q, k, cos, sin, impl="torch")
    ours = _scores(q[0], k[0])
    # fp32 projections and fp32 angles against float64: ~1e-6 of the largest score; a wrong pairing is ~1
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, f"scores off by {err:.3g} of the largest"


@pytest.mark.parametrize("head_dim,n_rot", [(16, 8), (16, 16), (44, 30), (5, 4)])
def test_partial_rope_llama_roundtrips_through_gguf(tmp_path, head_dim, n_rot):
    """Our decoder with partial rotary -> a llama GGUF with its Q/K rows in llama.cpp's order (``permute_qk``
    with n_rot) -> loaded again: the same logits. With the score test above, permute_qk(..., n_rot) is the
    layout in which llama.cpp computes what our decoder does."""
    cfg = _hf_cfg("llama", head_dim, n_rot)
    src = CausalLM(ModelConfig.from_hf_dict(cfg), impl="torch").init_weights(std=0.1, seed=0).eval()
    stored = {}
    for name, t in src.state_dict().items():
        heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
        stored[name] = permute_qk(t, heads, n_rot) if ".q_proj." in name or ".k_proj." in name else t
    path = tmp_path / "roundtrip.gguf"
    _write(path, "llama", cfg, n_rot, stored)
    ours = _converted(path, tmp_path)
    ids = torch.randint(0, cfg["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), src(ids)
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-6


def test_partial_permutation_interleaves_only_the_rotated_rows():
    # one head, D = 8, n_rot = 4: rows (a0 a1 b0 b1 | t0 t1 t2 t3) -> (a0 b0 a1 b1 | t0 t1 t2 t3)
    w = torch.arange(8.0).view(8, 1)
    assert permute_qk(w, 1, 4).flatten().tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    for rows, heads, n_rot in [(48, 3, 8), (48, 3, 2), (44, 1, 30), (32, 2, 16)]:
        x = torch.randn(rows, 5)
        assert torch.equal(unpermute_qk(permute_qk(x, heads, n_rot), heads, n_rot), x)
        assert torch.equal(unpermute_qk(x, heads, rows // heads), unpermute_qk(x, heads))  # full: as before
        b = torch.randn(rows)  # q/k biases alike
        assert torch.equal(unpermute_qk(permute_qk(b, heads, n_rot), heads, n_rot), b)


@pytest.mark.parametrize("n_rot", [7, 0, 20])
def test_bad_rope_dimension_count_names_the_file_and_field(tmp_path, n_rot):
    cfg = _hf_cfg("llama", 16, 16)
    path = tmp_path / f"bad-{n_rot}.gguf"
    _write(path, "llama", cfg, n_rot, _random_stored(cfg))
    with pytest.raises(ValueError, match=rf"bad-{n_rot}\.gguf: metadata llama\.rope\.dimension_count={n_rot} .*"
                                         r"even.*head_dim"):
        gguf_io.convert_gguf(path, tmp_path / "out")


def test_load_model_reads_a_partial_rope_gguf(tmp_path):
    """Through the conversion cache: from_json lets a partial rotary config through there (its cache entry says the
    directory is our conversion) and refuses the same config.json elsewhere, as transformers would misread it."""
    import shutil

    import chronicals

    cfg = _hf_cfg("llama", 16, 8)
    path = tmp_path / "partial.gguf"
    _write(path, "llama", cfg, 8, _random_stored(cfg))
    loaded, _ = chronicals.load_model(path, tokenizer=False, impl="torch")
    assert loaded.config.rotary_dim == 8
    ids = torch.randint(0, cfg["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids), _converted(path, tmp_path)(ids), rtol=0, atol=0)
    plain = tmp_path / "copied"
    shutil.copytree(gguf_io.convert_gguf(path, tmp_path / "again"), plain)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5, but transformers' llama code.*load_model"):
        ModelConfig.from_json(plain / "config.json")


def test_export_of_an_adapter_on_a_partial_rope_gguf_says_what_works(tmp_path, capsys):
    """``chronicals export`` of a LoRA adapter whose base is a GGUF file with partial rope: save_model refuses to
    write the merged model (a Hugging Face directory would load as another model). The refusal is a message, exit
    status 3, no traceback, and it says what works instead (the adapter as it is, with chat/eval --adapter)."""
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


def test_convert_gguf_refuses_a_folder_with_other_files_before_writing(tmp_path):
    """convert_gguf(gguf, out_dir) replaced an existing out_dir whatever it held: a folder of notes, or the folder
    holding the .gguf itself, was emptied without a word. Now as save_model: refused, naming the files, nothing
    written; a previous conversion (a model's files only, with a cache entry's record and tokenizer error: a copied
    cache entry, an earlier export of a file whose tokenizer failed) is still replaced."""
    cfg = _hf_cfg("llama", 16, 16)
    path = tmp_path / "m.gguf"
    _write(path, "llama", cfg, 16, _random_stored(cfg))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds files this save would delete \(.*m\.gguf.*notes\.txt"):
        gguf_io.convert_gguf(path, tmp_path)
    assert path.is_file() and (tmp_path / "notes.txt").read_text() == "mine"
    out = gguf_io.convert_gguf(path, tmp_path / "hf", cache_entry={"source": str(path)})
    (out / gguf_cache.TOKENIZER_ERROR).write_text(gguf_cache.tokenizer_error_json("no tokenizer"))
    assert (out / gguf_cache.CACHE_ENTRY).is_file()
    assert gguf_io.convert_gguf(path, out) == out and (out / "config.json").is_file()  # its own files: replaced
    assert not (out / gguf_cache.CACHE_ENTRY).exists() and not (out / gguf_cache.TOKENIZER_ERROR).exists()


def test_a_gguf_without_its_suffix_loads_and_other_files_say_what_a_model_is(tmp_path):
    """A .gguf saved without its suffix was told 'for a file inside a directory pass the directory', which then
    failed too; it is read by its magic bytes now. A model directory's config.json points to its directory."""
    import shutil

    cfg = _hf_cfg("llama", 16, 16)
    path = tmp_path / "m.gguf"
    _write(path, "llama", cfg, 16, _random_stored(cfg))
    bare = tmp_path / "model-q8"
    shutil.copyfile(path, bare)
    a, _ = chronicals.load_model(path, tokenizer=False, impl="torch")
    b, _ = chronicals.load_model(bare, tokenizer=False, impl="torch")
    ids = torch.randint(0, cfg["vocab_size"], (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(a.eval()(ids), b.eval()(ids))
    hf = gguf_io.convert_gguf(path, tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"a model is a Hugging Face directory or a \.gguf file; for a file of a "
                                         rf"model directory pass the directory \({hf}\)"):
        chronicals.load_model(hf / "config.json", tokenizer=False)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"this file is neither \(it does not start with GGUF's magic bytes\)"):
        chronicals.load_model(tmp_path / "notes.txt", tokenizer=False)


def test_convert_gguf_holds_one_shard_of_float32_at_a_time(tmp_path, monkeypatch):
    """convert_gguf built the whole model in float32 before writing it: an 8B Q4 file needed ~32 GB of RAM. Now the
    tensors are dequantized shard by shard (CONVERT_SHARD_BYTES, here shrunk to 1.5 embeddings): never more than one
    shard's bytes alive, HF-style shards plus an index, and the same model as the single-file conversion."""
    import gc
    import weakref

    cfg = _hf_cfg("llama", 16, 8)
    path = tmp_path / "m.gguf"
    _write(path, "llama", cfg, 8, _random_stored(cfg))
    single = _converted(path, tmp_path)
    limit = 3 * 4 * cfg["vocab_size"] * cfg["hidden_size"] // 2  # an embedding and a half: 3+ shards
    monkeypatch.setattr(gguf_io, "CONVERT_SHARD_BYTES", limit)
    alive: list[weakref.ref] = []
    most = 0
    made = gguf_io.gguf_tensor

    def counted(*args, **kwargs):
        nonlocal most
        gc.collect()
        w = made(*args, **kwargs)
        alive.append(weakref.ref(w))
        live = [r() for r in alive if r() is not None]
        most = max(most, sum(t.numel() * 4 for t in live))
        return w

    monkeypatch.setattr(gguf_io, "gguf_tensor", counted)
    out = gguf_io.convert_gguf(path, tmp_path / "sharded")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    assert 0 < most <= limit, (most, limit)
    sd = {}
    for shard in shards:
        sd.update(load_file(str(out / shard)))
    assert sd.keys() == single.state_dict().keys()
    for k, v in single.state_dict().items():
        assert torch.equal(sd[k], v), k
