"""GGUF metadata in: GGUF files written here from tiny random transformers models (llama.cpp's conventions:
names, Q/K row permutation for ``llama``, metadata keys: rope scaling, per-layer values, the tokenizer, damaged
values), read back by chronicals and compared with the transformers model on the same weights."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import chronicals
from chronicals.models import convert_gguf
from chronicals.models.gguf_tokenizer import READS_TOKENIZER_MODEL, transformers_version
from test_gguf import _gguf_name, llama_cpp_rows  # llama.cpp's names and layout, apart from gguf_io's own

pytestmark = pytest.mark.usefixtures("one_thread")

T = gguf.GGMLQuantizationType


def hf_model(model_type: str, **over):
    """A tiny random transformers model (norm weights near 1, everything else ~0.1)."""
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, bos_token_id=1,
               eos_token_id=2)
    cfg.update(over)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(model_type, **cfg),
                                                      dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("norm.weight") else 0.0))
    return m


def write_gguf(path, arch: str, m, *, skip=(), extra=None) -> None:
    """``m`` as llama.cpp's convert_hf_to_gguf.py writes it (F32 tensors): Q/K rows permuted for llama, tied
    lm_head left out. skip: writer add_* metadata to leave out; extra(writer): more metadata."""
    c = m.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    meta = dict(block_count=c.num_hidden_layers, context_length=c.max_position_embeddings,
                embedding_length=c.hidden_size, feed_forward_length=c.intermediate_size, head_count=heads,
                head_count_kv=kv, key_length=head_dim, value_length=head_dim, rope_dimension_count=head_dim,
                layer_norm_rms_eps=c.rms_norm_eps, rope_freq_base=c.rope_parameters["rope_theta"],
                vocab_size=c.vocab_size)
    for k, v in meta.items():
        if k not in skip:
            getattr(w, f"add_{k}")(v)
    if extra:
        extra(w)
    for name, t in m.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w.add_tensor(_gguf_name(name), llama_cpp_rows(arch, name, t, heads, kv).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rel_err(ours, m, n: int = 40) -> float:
    ids = torch.randint(0, m.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids), m(ids).logits
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("how", ["factor_only", "legacy_scale_linear", "typed"])
def test_linear_rope_scaling_by_its_factor_alone(tmp_path, how):
    """llama.cpp reads a missing rope.scaling.type as linear and the factor from rope.scaling.factor or the
    older rope.scale_linear (files of older converters): both were ignored, so positions were off by 4x
    (logits 90% off past the first tokens) without a word."""
    m = hf_model("llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    extra = {"factor_only": lambda w: w.add_rope_scaling_factor(4.0),
             "legacy_scale_linear": lambda w: w.add_float32("llama.rope.scale_linear", 4.0),
             "typed": lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                 w.add_rope_scaling_factor(4.0))}[how]
    path = tmp_path / f"{how}.gguf"
    write_gguf(path, "llama", m, extra=extra)
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert _rel_err(ours, m) <= 1e-5


def test_rope_scaling_type_none_never_scales(tmp_path):
    m = hf_model("llama")
    path = tmp_path / "none.gguf"
    write_gguf(path, "llama", m, extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.NONE),
                                                  w.add_rope_scaling_factor(4.0)))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.rope_scaling is None and _rel_err(ours, m) <= 1e-5


@pytest.mark.parametrize("key", ["llama.rope.scaling.factor", "llama.rope.scale_linear"])
def test_a_zero_rope_scaling_factor_is_no_scaling(tmp_path, key):
    """A rope.scaling.factor (or the older rope.scale_linear) of 0 means "no scaling", as llama.cpp reads it
    (`if (ropescale != 0.0f)`): read as a linear rope of factor 0, a valid file was refused by ModelConfig."""
    m = hf_model("llama")
    path = tmp_path / "zero_factor.gguf"
    write_gguf(path, "llama", m, extra=lambda w: w.add_key_value(key, 0.0, gguf.GGUFValueType.FLOAT32))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.rope_scaling is None and _rel_err(ours, m) <= 1e-5


def test_a_float32_rope_scaling_factor_reads_as_its_shortest_decimal(tmp_path):
    """rope.scaling.factor is stored as float32: 1.1 is read back as 1.1 (the Hugging Face release's value) in the
    model config and in the converted config.json, not as 1.100000023841858."""
    path = tmp_path / "factor.gguf"
    write_gguf(path, "llama", hf_model("llama"), extra=lambda w: w.add_rope_scaling_factor(1.1))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.rope_scaling == {"rope_type": "linear", "factor": 1.1}
    out = convert_gguf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["factor"] == 1.1


# a damaged file's metadata: (writer add_* left out, what is written instead, the error's pattern)
_DAMAGED = {
    # 6 heads of 16 over 2 kv heads: K has 32 rows, which 3 kv heads cannot split into rotary pairs; was a bare
    # "RuntimeError: shape '[3, 5, 2, 96]' is invalid" from the un-permutation, naming no file
    "kv_heads": ("head_count_kv", lambda w: w.add_head_count_kv(3),
                 r"tensor 'blk\.0\.attn_k\.weight' has 32 rows, which do not split into rotary pairs of metadata "
                 r"llama\.attention\.head_count_kv=3 heads; the file's metadata is damaged: convert the model again"),
    # was a bare "ValueError: could not convert string to float: 'x'"
    "eps_string": ("layer_norm_rms_eps", lambda w: w.add_string("llama.attention.layer_norm_rms_epsilon", "x"),
                   r"metadata llama\.attention\.layer_norm_rms_epsilon='x' is not a number; the file's metadata is "
                   r"damaged .*convert the model again"),
    # per-layer kv heads that differ: was a bare "TypeError: int() argument must be ... not 'list'"
    "kv_per_layer": ("head_count_kv", lambda w: w.add_array("llama.attention.head_count_kv", [2, 3]),
                     r"metadata llama\.attention\.head_count_kv=\[2, 3\] is not an integer \(per-layer values that "
                     r"differ"),
    "heads_string": ("head_count", lambda w: w.add_string("llama.attention.head_count", "6"),
                     r"metadata llama\.attention\.head_count='6' is not an integer"),
    # 0 kv heads: a bare ZeroDivisionError (ModelConfig reads 0 as "not set": as many kv heads as heads)
    "kv_heads_zero": ("head_count_kv", lambda w: w.add_head_count_kv(0),
                      r"tensor 'blk\.0\.attn_k\.weight' has 32 rows, which do not split into rotary pairs of "
                      r"metadata llama\.attention\.head_count_kv=0 heads"),
    # a token id that is no integer: a bare "invalid literal for int()" naming no file or key
    "bos_string": (None, lambda w: w.add_string("tokenizer.ggml.bos_token_id", "abc"),
                   r"metadata tokenizer\.ggml\.bos_token_id='abc' is not a token id \(an integer >= 0\)"),
}


@pytest.mark.parametrize("case", list(_DAMAGED))
def test_damaged_metadata_names_the_file_and_the_key(tmp_path, case):
    skip, extra, pattern = _DAMAGED[case]
    m = hf_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, "llama", m, skip=(skip,), extra=extra)
    with pytest.raises(ValueError, match=rf"^{path}: {pattern}"):
        chronicals.load_model(path, tokenizer=False)


def test_per_layer_metadata_alike_for_every_layer_loads(tmp_path):
    """llama.cpp accepts an array of one value per layer for head counts and the feed-forward width."""
    m = hf_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=64)
    path = tmp_path / "per_layer.gguf"
    write_gguf(path, "llama", m, skip=("head_count_kv", "feed_forward_length"),
               extra=lambda w: (w.add_array("llama.attention.head_count_kv", [2, 2]),
                                w.add_array("llama.feed_forward_length", [64, 64])))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert ours.config.num_key_value_heads == 2 and _rel_err(ours, m) <= 1e-5


def _write_empty_per_layer_array(path, key: bytes = b"llama.feed_forward_length", pad: bytes = b"zz.pad") -> None:
    """A GGUF whose ``key`` is an empty INT32 array. gguf's writer refuses empty arrays, so a 1-element array is
    written and its element cut out; a padding string grows by the same 4 bytes, so every offset after the metadata
    (tensor infos, aligned tensor data) stays where the writer put it."""
    write_gguf(path, "llama", hf_model("llama"), skip=("feed_forward_length",),
               extra=lambda w: (w.add_array(key.decode(), [96]), w.add_string(pad.decode(), "x")))
    raw = path.read_bytes()
    i = raw.index(key) + len(key)  # then: type ARRAY (9), item type INT32 (5), count 1 (u64), the element (u32)
    assert struct.unpack_from("<IIQ", raw, i) == (9, 5, 1)
    raw = raw[:i + 8] + struct.pack("<Q", 0) + raw[i + 20:]
    j = raw.index(pad) + len(pad)  # then: type STRING (8), length 1 (u64), "x"
    assert struct.unpack_from("<IQ", raw, j) == (8, 1)
    raw = raw[:j + 4] + struct.pack("<Q", 5) + b"xabcd" + raw[j + 13:]
    path.write_bytes(raw)


def test_an_empty_per_layer_array_names_the_file_and_the_key(tmp_path):
    """An empty array where a per-layer value belongs (a damaged file) is refused naming the file and the key, not
    a bare IndexError out of the per-layer collapse."""
    path = tmp_path / "empty_array.gguf"
    _write_empty_per_layer_array(path)
    with pytest.raises(ValueError, match=rf"^{path}: metadata llama\.feed_forward_length=\[\] is not an integer"):
        chronicals.load_model(path, tokenizer=False)


def test_a_split_count_of_one_is_a_whole_file_and_loads(tmp_path):
    """llama.cpp's gguf-split writes split.count into every part, 1 when the model fit in one: such a file is the
    whole model and loads (only split.count > 1 is one part of several); it was refused as "part 1 of 1 of a split
    GGUF"."""
    m = hf_model("llama")
    path = tmp_path / "whole.gguf"
    write_gguf(path, "llama", m, extra=lambda w: (w.add_uint16("split.count", 1), w.add_uint16("split.no", 0)))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert _rel_err(ours, m) <= 1e-5


def _bpe_tokenizer_metadata(w, *, model: str = "gpt2", merges: bool = True, pre: str | None = "gpt-2",
                            eos_id: int | None = 2, add_bos: bool | None = False) -> None:
    """A tiny byte-level BPE tokenizer as llama.cpp writes one (SmolLM2 / Qwen style): 3 special tokens, the
    256 byte symbols, 3 merges, a ChatML template; pre: tokenizer.ggml.pre, eos_id: tokenizer.ggml.eos_token_id,
    add_bos: tokenizer.ggml.add_bos_token (None: each left out)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    VT = gguf.GGUFValueType
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_syms = list(bytes_to_unicode().values())
    tokens = specials + byte_syms + ["he", "ll", "hell"]
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_string("tokenizer.ggml.pre", pre)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    if merges:
        w.add_token_merges(["h e", "l l", "he ll"])
    w.add_bos_token_id(1)
    if eos_id is not None:
        w.add_eos_token_id(eos_id)
    w.add_key_value("tokenizer.ggml.padding_token_id", 0, VT.UINT32)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


_BPE_VOCAB = 3 + 256 + 3


@pytest.mark.parametrize("how", [dict(model="rwkv"), dict(merges=False)])
def test_tokenizer_transformers_cannot_convert_leaves_the_weights_loadable(tmp_path, how):
    """A GGUF whose tokenizer.ggml.* transformers' converter refuses (another tokenizer model; merges missing:
    a bare KeyError 'scores') failed the whole conversion, so load_model(..., tokenizer=False) failed too with
    an error naming no file; the weights load now and the tokenizer's error names the file. The 'rwkv' file:
    transformers 5.18 on refuse it; 5.17 built it as byte-level BPE (tokenizer.ggml.model unread), which we refuse."""
    m = hf_model("llama", vocab_size=_BPE_VOCAB)
    path = tmp_path / "badtok.gguf"
    write_gguf(path, "llama", m, extra=lambda w: _bpe_tokenizer_metadata(w, **how))
    ours, tok = chronicals.load_model(path, tokenizer=False)
    assert tok is None and _rel_err(ours, m) <= 1e-5
    ours_refuses = "model" in how and transformers_version() < READS_TOKENIZER_MODEL
    fix = r"upgrade transformers \(pip install -U 'transformers>=5\.18' .+\), or " if ours_refuses else ""
    with pytest.raises(ValueError, match=rf"^{path}: its tokenizer metadata \(tokenizer\.ggml\.\*\) cannot be made "
                                         r"into a tokenizer by transformers' GGUF converter \(.+\); "
                                         rf"{fix}use the tokenizer of the model's Hugging Face directory"):
        chronicals.load_model(path)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bpe_tokenizer_and_chat_template_survive_the_conversion(tmp_path, arch):
    """The cached tokenizer (transformers' GGUF conversion, saved and read back) tokenizes like transformers'
    own GGUF tokenizer: special tokens, merges, bytes, the chat template; the tokenizer and the config take
    bos/eos/pad from the file (transformers 5.17 gave a qwen2 file no bos and a llama file eos = its bos token)."""
    m = hf_model(arch, vocab_size=_BPE_VOCAB, bos_token_id=1, eos_token_id=2)
    path = tmp_path / "bpe.gguf"
    pre = "qwen2" if arch == "qwen2" else "gpt-2"  # each architecture's own split
    write_gguf(path, arch, m, extra=lambda w: _bpe_tokenizer_metadata(w, pre=pre))
    ours, tok = chronicals.load_model(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello", "<|im_start|>user\nhell<|im_end|>", "a<|endoftext|>b", "é 🤗\t\n  x", ""]:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    assert tok.convert_ids_to_tokens(tok("hello")["input_ids"]) == ["hell", "o"]  # the merges applied
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False) == \
        ref.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert (ours.config.bos_token_id, ours.config.eos_token_id, ours.config.pad_token_id) == (1, 2, 0)
    assert _rel_err(ours, m) <= 1e-5


def test_a_gguf_without_its_suffix_gives_its_tokenizer(tmp_path):
    """A GGUF saved without its .gguf suffix (read by its magic bytes) gives the tokenizer its metadata carries, and
    the tokenizer names the file: its weights loaded, but its tokenizer was looked for as a directory's and refused
    as "no tokenizer metadata"."""
    path = tmp_path / "model-download"  # a browser's download, suffix lost
    write_gguf(path, "llama", hf_model("llama", vocab_size=_BPE_VOCAB), extra=_bpe_tokenizer_metadata)
    _, tok = chronicals.load_model(path)
    assert tok.chronicals_source == str(path)
    assert len(tok) == _BPE_VOCAB and tok.chat_template


def test_a_gguf_model_records_the_gguf_file_as_its_base(tmp_path, monkeypatch):
    """A model loaded from a .gguf (by a relative path) records that file, absolute, as its base (what an adapter
    saved from it names), not the cache directory its conversion was read from (gone once the cache is pruned, and
    on another machine)."""
    write_gguf(tmp_path / "tiny.gguf", "llama", hf_model("llama"))
    monkeypatch.chdir(tmp_path)
    model, _ = chronicals.load_model("tiny.gguf", tokenizer=False)
    assert model.chronicals_base == str((tmp_path / "tiny.gguf").resolve())


def test_tensor_type_unknown_to_gguf_is_named(tmp_path):
    """A tensor type id the gguf package does not know (a newer llama.cpp's) was reported as "not a readable
    GGUF file (... np.uint32(77) is not a valid GGMLQuantizationType); the file is truncated or corrupt, copy it
    again", a fix that cannot work."""
    m = hf_model("llama")
    path = tmp_path / "newtype.gguf"
    write_gguf(path, "llama", m)
    reader = gguf.GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight").field
    at = field.parts[4].ctypes.data - reader.data.ctypes.data  # parts: name len, name, n_dims, dims, type, offset
    assert int(field.parts[4][0]) == T.F32
    del reader, field
    data = bytearray(path.read_bytes())
    data[at:at + 4] = (77).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{path}: a tensor is stored in GGML type 77, which the installed gguf "
                                         r"package \(.+\) does not know .*; upgrade gguf \(pip install -U gguf\), or "
                                         r"re-export the model as F16"):
        chronicals.load_model(path, tokenizer=False)


@pytest.mark.parametrize("model_type,arch,over", [
    ("llama", "llama", dict(head_dim=32, rope_theta=500000.0)),  # head_dim != hidden / heads: key_length
    ("llama", "llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, num_key_value_heads=1)),
    ("qwen2", "qwen2", dict(tie_word_embeddings=True)),
    ("qwen3", "qwen3", dict(head_dim=32, rope_theta=1000000.0)),
])
def test_logits_equal_the_transformers_model(tmp_path, model_type, arch, over):
    """F32 files of transformers models (not of our decoder): the same logits, and the config fields kept."""
    m = hf_model(model_type, **over)
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(path, arch, m, extra=lambda w: (w.add_bos_token_id(1), w.add_eos_token_id(2)))
    ours, _ = chronicals.load_model(path, tokenizer=False)
    assert _rel_err(ours, m) <= 1e-5
    c, want = ours.config, m.config
    assert (c.tie_word_embeddings, c.head_dim, c.num_key_value_heads, c.max_position_embeddings, c.rms_norm_eps,
            c.rope_theta, c.bos_token_id, c.eos_token_id) == \
        (want.tie_word_embeddings, getattr(want, "head_dim", 16), want.num_key_value_heads, 256, 1e-5,
         want.rope_parameters["rope_theta"], 1, 2)


@pytest.mark.parametrize("change", ["drop", "extra"])
def test_missing_or_extra_tensor_is_named(tmp_path, change):
    m = hf_model("llama")
    sd = m.state_dict()
    if change == "drop":
        del sd["model.layers.1.self_attn.v_proj.weight"]
    else:
        sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)  # a qwen3 tensor in a llama file
    m.state_dict = lambda: sd
    path = tmp_path / f"{change}.gguf"
    write_gguf(path, "llama", m)
    want = (r"missing tensors: model\.layers\.1\.self_attn\.v_proj\.weight" if change == "drop"
            else r"tensors beyond them: model\.layers\.1\.self_attn\.q_norm\.weight")
    with pytest.raises(ValueError, match=rf"^{path}: the tensors do not match the file's metadata .*{want}.*convert "
                                         r"the model again with llama\.cpp's convert_hf_to_gguf\.py"):
        chronicals.load_model(path, tokenizer=False)


def test_a_zero_block_count_in_a_gguf_does_not_ask_for_a_config_json(tmp_path):
    """GGUF metadata ModelConfig refuses (block_count 0) said "fix config.json", a file a GGUF user does not have."""
    m = hf_model("llama")
    path = tmp_path / "zero.gguf"
    write_gguf(path, "llama", m, skip=("block_count",), extra=lambda w: w.add_block_count(0))
    with pytest.raises(ValueError, match=rf"^{path}: num_hidden_layers=0 must be an integer >= 1; the file's "
                                         r"metadata is damaged .*convert the model again") as e:
        chronicals.load_model(path, tokenizer=False)
    assert "config.json" not in str(e.value)


@pytest.mark.parametrize("skip, key, says", [("rope_freq_base", "llama.rope.freq_base", "a number"),
                                             ("context_length", "llama.context_length", "an integer"),
                                             (None, "tokenizer.ggml.eos_token_id", "a token id")])
def test_a_boolean_where_a_number_belongs_is_refused(tmp_path, skip, key, says):
    """A bool is an int to Python: a damaged file's rope.freq_base=true loaded as rope_theta 1.0 (every rotary angle
    wrong, silently), context_length=true as a one-token context, and tokenizer.ggml.eos_token_id=true went into
    config.json as eos_token_id true, which no generated token id equals."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_model("llama"), skip=(skip,),
               extra=lambda w: w.add_key_value(key, True, gguf.GGUFValueType.BOOL))
    with pytest.raises(ValueError, match=rf"^{path}: metadata {key}=True is not {says}"):
        chronicals.load_model(path, tokenizer=False)


@pytest.mark.parametrize("key", ["bos_token_id", "eos_token_id", "padding_token_id"])
def test_a_negative_token_id_is_refused(tmp_path, key):
    """A token id stored as a signed -1 (llama.cpp writes uint32) is no token: it went into config.json as
    bos/eos/pad_token_id=-1, which no token matches (generation never stops at that eos), without a word."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_model("llama"),
               extra=lambda w: w.add_key_value(f"tokenizer.ggml.{key}", -1, gguf.GGUFValueType.INT32))
    with pytest.raises(ValueError, match=rf"^{path}: metadata tokenizer\.ggml\.{key}=-1 is not a token id "
                                         r"\(an integer >= 0\)"):
        chronicals.load_model(path, tokenizer=False)


def test_converted_config_json_records_float32(tmp_path):
    """convert_gguf writes config.json with dtype "float32", the dtype of the safetensors it writes, so transformers'
    from_pretrained(dtype="auto") loads the dequantized weights as they are (another dtype there rounds every weight
    on load)."""
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", hf_model("llama"))
    out = convert_gguf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F32"}
