"""Shared fixtures: a per-session GGUF cache, the embedded SmolLM2 GGUF, tiny HF configs of every family."""

from __future__ import annotations

import shutil

import pytest
import torch

# Tiny shapes chosen so every code path differs from the plain case: odd vocab, GQA, head_dim not
# hidden/heads (qwen3), rope scaling whose three bands (kept, smoothed, divided) are all populated (llama3).
_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128, hidden_act="silu",
               bos_token_id=1, eos_token_id=2)
FAMILIES = {
    # Llama 2: multi-head attention (no GQA), untied
    "llama2": dict(model_type="llama", num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False),
    # Llama 3.x: GQA, llama3 rope scaling. head_dim 8, theta 1e4 -> wavelengths 6.3 (< 64/4: kept),
    # 62.8 (between 16 and 64: smoothed), 628 and 6283 (> 64: divided by 8)
    "llama3": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Llama with attention and MLP biases (the attention_bias / mlp_bias options)
    "llama_bias": dict(model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    # Qwen2/2.5: q/k/v bias, tied (the small Qwen2.5 checkpoints tie)
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
    # Qwen3: per-head q/k RMSNorm, head_dim (16) != hidden / heads (8)
    "qwen3": dict(model_type="qwen3", head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False),
    # Mistral: GQA, a sliding window wider than every test sequence
    "mistral": dict(model_type="mistral", sliding_window=4096, rope_theta=1000000.0, tie_word_embeddings=False),
    # SmolLM2: llama with tied embeddings and GQA 3:1
    "smollm2": dict(model_type="llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                    rope_theta=100000.0, tie_word_embeddings=True),
}


def make_tiny_hf_config(family: str, **overrides) -> dict:
    """A Hugging Face config.json dict of a tiny model of ``family`` (one of FAMILIES)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    return {**_COMMON, **FAMILIES[family], **overrides}


def pytest_generate_tests(metafunc):
    """A test that takes an ``hf_family`` argument runs once per family of FAMILIES."""
    if "hf_family" in metafunc.fixturenames:
        metafunc.parametrize("hf_family", list(FAMILIES))


@pytest.fixture(scope="session")
def tiny_hf_config():
    """``tiny_hf_config(family, **overrides) -> dict`` (families: llama2, llama3, llama_bias, qwen2, qwen3,
    mistral, smollm2)."""
    return make_tiny_hf_config


@pytest.fixture(scope="session", autouse=True)
def chronicals_cache(tmp_path_factory):
    """Each test session converts GGUF files into its own cache (never ~/.cache), removed at the end
    (the SmolLM2 conversion is 540 MB)."""
    d = tmp_path_factory.mktemp("chronicals_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CHRONICALS_CACHE", str(d))
        yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF (fails with the pip command when missing)."""
    from chronicals.models.loading import resolve_path

    return resolve_path("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
    """(model, tokenizer) of the embedded SmolLM2 loaded by chronicals (float32, CPU, eval mode), once."""
    from chronicals import load_model

    return load_model(smollm2_gguf_path)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module that runs the 135M model: on a busy 2-core machine two OpenMP
    threads spin against other processes (8 greedy SmolLM2 tokens: 11.4 s with 2 threads vs 1.3 s with 1,
    at load average 6)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def save_tiny_base(tmp_path_factory):
    """save(tokenizer) -> a new HF directory: a tiny random Llama (2 layers, hidden 32, tied) sized to the
    tokenizer's vocabulary, saved with it."""
    def save(tok):
        import transformers

        from chronicals import save_model
        from chronicals.models import CausalLM, ModelConfig

        hf = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
        model = CausalLM(ModelConfig.from_hf_dict(hf.to_dict())).init_weights(seed=0)
        return save_model(model, tok, tmp_path_factory.mktemp("tiny") / "base")
    return save


@pytest.fixture(scope="module")
def tiny_base(save_tiny_base):
    """A saved tiny random Llama (HF directory) with the embedded SmolLM2 tokenizer (real chat template, 49152
    tokens): what the CLI tests train, chat with and export."""
    from chronicals import load_tokenizer

    return save_tiny_base(load_tokenizer("smollm2-135m-instruct"))


@pytest.fixture
def no_flock(monkeypatch):
    """A file system that takes no flock (ENOLCK, as some network mounts answer): every fcntl.flock raises."""
    import errno
    import fcntl

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
