"""Our decoder vs transformers' own model classes on the same weights, for every supported family.

The reference is transformers' float32 model; our names equal HF's, so one state dict serves both.
Tolerances (float32): logits 1e-5 and gradients 1e-4, relative to the largest magnitude of the reference.

config.json fields that change the model's math, read through our loader and checked against transformers: each
case builds a tiny random model with transformers, saves it (safetensors), edits config.json where the case needs
a form transformers' own config classes would not write, loads it with ``load_hf_dir`` and compares logits (and
for yarn every gradient) with transformers' model on the same files, float32. What we cannot compute as
transformers does must be refused at load (or at the step that would differ) naming the field.
"""

import json

import pytest
import torch
import transformers

from chronicals.models import CausalLM, ModelConfig
from chronicals.models.hf_io import load_hf_dir


def _hf_model(cfg_dict: dict, seed: int = 0):
    """A transformers model of ``cfg_dict`` with every parameter random and O(1) (norm weights around 1,
    nonzero biases), so a wrong or unused parameter changes the logits visibly."""
    cfg = transformers.AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _ours_from(hf_model, cfg_dict: dict) -> CausalLM:
    ours = CausalLM(ModelConfig.from_hf_dict(cfg_dict)).eval()
    ours.load_state_dict(hf_model.state_dict(), strict=True)
    return ours


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().max() / ref.abs().max()).item()


def test_logits_and_grads_match_transformers(hf_family, tiny_hf_config):
    cfg_dict = tiny_hf_config(hf_family)
    hf = _hf_model(cfg_dict)
    ours = _ours_from(hf, cfg_dict)
    assert set(dict(ours.named_parameters())) == set(dict(hf.named_parameters()))
    if cfg_dict["tie_word_embeddings"]:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight

    ids = torch.randint(0, cfg_dict["vocab_size"], (2, 37), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 37, cfg_dict["vocab_size"], generator=torch.Generator().manual_seed(2))
    ref = hf(ids).logits
    out = ours(ids)
    assert out.shape == (2, 37, cfg_dict["vocab_size"])
    assert _rel(out, ref) <= 1e-5

    (ref * probe).sum().backward()
    (out * probe).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert _rel(p.grad, hf_params[name].grad) <= 1e-4, name


@pytest.mark.parametrize("family", ["llama3", "qwen3", "smollm2"])
def test_loss_matches_transformers(family, tiny_hf_config):
    """Our loss head (labels shifted inside) against transformers' loss on the same labels."""
    cfg_dict = tiny_hf_config(family)
    hf = _hf_model(cfg_dict, seed=3)
    ours = _ours_from(hf, cfg_dict)
    ids = torch.randint(0, cfg_dict["vocab_size"], (3, 21), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt without loss
    ref = hf(ids, labels=labels).loss
    assert abs(ours(ids, labels=labels).item() - ref.item()) <= 1e-5 * ref.abs().item()


def test_unsupported_model_type_lists_supported(tiny_hf_config):
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict(tiny_hf_config("llama2", model_type="gpt2"))


BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=64, hidden_act="silu",
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# yarn whose ramp has all three bands at head_dim 16, theta 1e4: rotations 0-1 kept, 2-5 ramped, 6-7 divided
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 2048}


def _saved(tmp_path, model_type: str, edit=None, **kw):
    """(transformers model, directory) of a tiny random ``model_type`` model; ``edit(config_dict)`` rewrites the
    saved config.json first, and transformers then reloads the model from the edited file."""
    hf = _hf_model({**BASE, "model_type": model_type, **kw})
    hf.save_pretrained(tmp_path)
    if edit is not None:
        path = tmp_path / "config.json"
        cfg = json.loads(path.read_text())
        edit(cfg)
        path.write_text(json.dumps(cfg))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    return hf, tmp_path


def _ids(seqlen=37):
    return torch.randint(0, BASE["vocab_size"], (2, seqlen), generator=torch.Generator().manual_seed(1))


def _assert_logits_match(hf, ours, seqlen=37):
    ids = _ids(seqlen)
    assert _rel(ours(ids), hf(ids).logits) <= 1e-5


def _set(**fields):
    return lambda cfg: cfg.update(fields)


def _old_rope_scaling(**rope):
    """An older config.json: rope_scaling (here with the older "type" key), no rope_parameters."""
    def edit(cfg):
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = rope
    return edit


MATCHING = {
    # yarn (Qwen2.5 / Qwen3 long-context configs): the attention factor 0.1 ln 4 + 1 scales cos and sin
    "yarn-qwen2": ("qwen2", None, dict(rope_parameters=YARN, max_position_embeddings=8192)),
    "yarn-qwen3-head_dim32": ("qwen3", None, dict(rope_parameters=YARN, head_dim=32)),
    "yarn-llama-factor-null": ("llama", None, dict(rope_parameters={**YARN, "factor": None},
                                                   max_position_embeddings=6144)),
    "yarn-mistral-attention_factor": ("mistral", None, dict(rope_parameters={**YARN, "attention_factor": 0.8})),
    "yarn-llama-mscale": ("llama", None, dict(rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 1.0})),
    "yarn-qwen2-betas-untruncated": ("qwen2", None, dict(rope_parameters={**YARN, "beta_fast": 8, "beta_slow": 2,
                                                                          "truncate": False})),
    "yarn-no-original": ("qwen3", _set(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), {}),
    "yarn-old-type-key": ("llama", _old_rope_scaling(type="yarn", factor=4.0, original_max_position_embeddings=2048),
                          {}),
    # dynamic NTK equals plain rope up to max_position_embeddings (37 tokens here, of 40)
    "dynamic-llama": ("llama", None, dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                          max_position_embeddings=40)),
    "dynamic-qwen2": ("qwen2", None, dict(rope_parameters={"rope_type": "dynamic", "factor": 3.0,
                                                           "rope_theta": 1e6}, max_position_embeddings=37)),
    # transformers reads rope_scaling first when a config.json has both
    "rope_scaling-over-rope_parameters": ("mistral", _set(rope_scaling={"rope_type": "linear", "factor": 3.0}), {}),
    "linear-old-type-key": ("qwen3", _old_rope_scaling(type="linear", factor=2.0), {}),
    # llama3 without original_max_position_embeddings: transformers takes max_position_embeddings (64)
    "llama3-no-original": ("llama", _set(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0, "rope_theta": 10000.0}), {}),
    # ... and a top-level one (Phi-3 style) over the one in the dict
    "llama3-top-level-original": ("qwen2", _set(original_max_position_embeddings=16, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256, "rope_theta": 10000.0}), {}),
    # Mistral / Qwen2 / Qwen3 MLPs have no bias in transformers whatever mlp_bias says (was: "missing tensors")
    "mlp_bias-mistral": ("mistral", None, dict(mlp_bias=True)),
    "mlp_bias-qwen2": ("qwen2", None, dict(mlp_bias=True)),
    "mlp_bias-qwen3": ("qwen3", None, dict(mlp_bias=True)),
    # Mistral / Qwen2 attention has no bias of attention_bias (Qwen2: q, k, v only, always), Llama / Qwen3 has
    "attention_bias-mistral": ("mistral", None, dict(attention_bias=True)),
    "attention_bias-qwen2": ("qwen2", None, dict(attention_bias=True)),
    # transformers' ACT2FN maps swish to SiLU (was refused)
    "swish-llama": ("llama", None, dict(hidden_act="swish")),
    # fields transformers' code for these families ignores, as we do
    "pretraining_tp-llama": ("llama", None, dict(pretraining_tp=2)),
    "softcapping-qwen3": ("qwen3", _set(final_logit_softcapping=30.0, attn_logit_softcapping=50.0), {}),
    "attention_dropout-eval": ("qwen2", None, dict(attention_dropout=0.1)),
}


@pytest.mark.parametrize("case", list(MATCHING))
def test_loaded_model_matches_transformers(tmp_path, case):
    model_type, edit, kw = MATCHING[case]
    hf, path = _saved(tmp_path, model_type, edit, **kw)
    ours = load_hf_dir(path)
    _assert_logits_match(hf, ours, seqlen=min(37, ours.config.max_position_embeddings))


def test_yarn_gradients_match_transformers(tmp_path):
    """The attention factor multiplies cos and sin, so q and k, and every gradient through them."""
    hf, path = _saved(tmp_path, "qwen3", rope_parameters=YARN, attention_bias=True)
    ours = load_hf_dir(path)
    assert ours.model.attention_scaling != 1.0
    ids, probe = _ids(), torch.randn(2, 37, BASE["vocab_size"], generator=torch.Generator().manual_seed(2))
    (hf(ids).logits * probe).sum().backward()
    (ours(ids) * probe).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, hf_params[name].grad) <= 1e-4, name


def test_dynamic_rope_refuses_sequences_past_max_positions(tmp_path):
    """Past max_position_embeddings transformers recomputes dynamic rope's frequencies for the batch."""
    _, path = _saved(tmp_path, "mistral", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                     max_position_embeddings=24)
    ours = load_hf_dir(path)
    ours(_ids(24))
    with pytest.raises(ValueError, match=r"25 tokens is longer than this model's max_position_embeddings=24, and its "
                                         r"rope_type is 'dynamic'.*within 24"):
        ours(_ids(25))
    ours(_ids(10), position_ids=torch.arange(14, 24)[None])  # the largest position counts, not the length
    with pytest.raises(ValueError, match=r"position_ids up to 24 \(25 positions\) are more than this model's "
                                         r"max_position_embeddings=24"):
        ours(_ids(10), position_ids=torch.arange(15, 25)[None])


def test_longrope_is_refused_naming_the_type():
    d = {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                         "long_factor": [2.0] * 8}}
    with pytest.raises(ValueError, match=r"cfg: rope_type='longrope': .*supported: default, linear, llama3, yarn, "
                                         r"dynamic; chronicals cannot load"):
        ModelConfig.from_hf_dict(d, source="cfg")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_other_activations_are_refused_naming_the_field(act):
    with pytest.raises(ValueError, match=rf"cfg: hidden_act='{act}': .*SwiGLU.*must be 'silu' \(or its alias "
                                         r"'swish'\)"):
        ModelConfig.from_hf_dict({**BASE, "model_type": "qwen2", "hidden_act": act}, source="cfg")


@pytest.mark.parametrize("where", ["top", "rope_parameters"])
def test_partial_rotary_factor_in_config_json_is_refused(tmp_path, where):
    """transformers' code for these families ignores it with plain rope (we rotated half the dims: logits off by
    ~100%) and fails with a scaled rope type."""
    def edit(cfg):
        (cfg if where == "top" else cfg["rope_parameters"])["partial_rotary_factor"] = 0.5
    hf, path = _saved(tmp_path, "llama", edit)
    with pytest.raises(ValueError, match=r"config.json: partial_rotary_factor=0.5, but transformers' llama code has "
                                         r"no partial rotary.*remove partial_rotary_factor from config.json"):
        load_hf_dir(path)
    edit_back = json.loads((path / "config.json").read_text())
    (edit_back if where == "top" else edit_back["rope_parameters"]).pop("partial_rotary_factor")
    (path / "config.json").write_text(json.dumps(edit_back))
    _assert_logits_match(hf, load_hf_dir(path))  # removed: what transformers computed all along


@pytest.mark.parametrize("model_type,extra", [("mistral", {}), ("qwen2", dict(use_sliding_window=True,
                                                                               max_window_layers=1)),
                                              ("qwen3", dict(use_sliding_window=True, max_window_layers=0))])
def test_sliding_window_defaults_like_transformers(model_type, extra):
    """A config.json without sliding_window gets the config class's 4096 (was: no window, so rows past 4096 tokens
    were attended in full); null means none."""
    d = {**BASE, "model_type": model_type, **extra}
    hf = transformers.AutoConfig.for_model(**d)
    assert hf.sliding_window == 4096
    assert ModelConfig.from_hf_dict(d).sliding_window == 4096
    assert ModelConfig.from_hf_dict({**d, "sliding_window": None}).sliding_window is None


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_missing_max_position_embeddings_defaults_like_transformers(model_type):
    """Dynamic rope and yarn without a factor read it (and chat/eval refuse sequences past it)."""
    d = {k: v for k, v in BASE.items() if k != "max_position_embeddings"}
    expected = transformers.AutoConfig.for_model(model_type, **d).max_position_embeddings
    assert ModelConfig.from_hf_dict({**d, "model_type": model_type}).max_position_embeddings == expected


def test_attention_dropout_refuses_a_training_step_only(tmp_path):
    _, path = _saved(tmp_path, "llama", attention_dropout=0.1)
    ours = load_hf_dir(path)
    with torch.no_grad():
        ours.train()(_ids())  # no gradient: no training step
    with pytest.raises(ValueError, match=r"attention_dropout=0.1: .*Set attention_dropout to 0.0 in the model's "
                                         r"config.json"):
        ours.train()(_ids(), labels=_ids())
    assert ours.config.to_hf_dict()["attention_dropout"] == 0.1  # written back as read


# ---- tie_word_embeddings against what the checkpoint stores (models/hf_io.py) ----

def _retie(path, keep: str, same: bool = False):
    """Set tie_word_embeddings: true in ``path``'s config.json and keep ``keep`` of the two matrices in the file
    ("both", "lm_head"); ``same`` makes the stored lm_head a copy of the embedding."""
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    sd = load_file(f)
    if same:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    if keep == "lm_head":
        del sd["model.embed_tokens.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def test_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    """transformers 5 keeps such a head apart from the embedding (4.x ties them); we used the embedding, silently."""
    _, path = _saved(tmp_path, "qwen2")
    hf = _retie(path, "both")
    assert not torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight)  # transformers 5: not tied
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true .* stores an lm_head.weight that differs from "
                                         r"model.embed_tokens.weight.*set tie_word_embeddings to false"):
        load_hf_dir(path)


@pytest.mark.parametrize("keep,same", [("both", True), ("lm_head", False)])
def test_tied_config_with_a_copied_or_only_a_head_matches_transformers(tmp_path, keep, same):
    """A head equal to the embedding (.bin conversions store both) loads; a head stored alone is the embedding
    (transformers ties the missing one to it; we refused: missing model.embed_tokens.weight)."""
    _, path = _saved(tmp_path, "llama")
    hf = _retie(path, keep, same)
    ours = load_hf_dir(path)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    _assert_logits_match(hf, ours)


def test_untied_config_without_a_head_says_to_tie(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _saved(tmp_path, "mistral")
    sd = load_file(path / "model.safetensors")
    del sd["lm_head.weight"]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: lm_head.weight; .*needs tie_word_embeddings: true"):
        load_hf_dir(path)


def test_saving_a_partial_rotary_model_is_refused(tmp_path):
    """A GGUF may rotate part of each head; transformers' config.json for these families cannot say so."""
    from chronicals import save_model
    from chronicals.models import CausalLM

    cfg = ModelConfig.from_hf_dict({**BASE, "model_type": "llama", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"rotates 8 of its head_dim=16 dims \(partial_rotary_factor=0.5\)"):
        save_model(CausalLM(cfg), None, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rope", [{**YARN, "factor": None, "mscale": 0.707, "mscale_all_dim": 1.0},
                                  {**YARN, "attention_factor": 0.8, "beta_fast": 8, "truncate": False}])
def test_saved_scaled_rope_reads_back_the_same_in_transformers(tmp_path, rope):
    """save_model writes the rope parameters back (config.to_hf_dict) so that transformers computes what we did."""
    from chronicals import save_model

    original, path = _saved(tmp_path / "in", "qwen3", rope_parameters=rope, max_position_embeddings=4096)
    out = save_model(load_hf_dir(path), None, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    ids = _ids()
    assert _rel(hf(ids).logits, original(ids).logits) <= 1e-6  # transformers reads the rope we wrote as the original
    _assert_logits_match(original, load_hf_dir(out))
