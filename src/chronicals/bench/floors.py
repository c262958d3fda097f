"""Per-family time floors of one training step: where a step's time goes, against what it could cost.

A profile (benchmarks/profile_step.py) groups a step's kernel time into families (GEMMs, attention, RMSNorm,
SwiGLU, ...). This module gives each family the time it would take if its kernels ran at this GPU's measured
ceilings, so a missed throughput target can be split into "work at its floor" and "gap":

- GEMMs and attention: their FLOPs at the bf16 matmul rate measured in the same run (``matmul_peak_tflops``).
  GEMM FLOPs: 6 x matmul params per token for full fine-tuning, 4 x for LoRA (frozen weights have no
  weight-gradient GEMM) plus the adapters' 6 r (in + out) per adapted projection. Attention: the MFU formula's
  causal 3 x 4 x seq x (heads x head_dim) / 2 per token and layer (forward + a backward of twice its FLOPs).
- Bandwidth-bound families: the bytes they must move at the copy bandwidth measured in the same run, with
  ANCHORS.md's counts (bf16, 2 bytes): RMSNorm forward 2NH and backward 3NH per norm (2 a layer + the final
  one); SwiGLU forward 3NI, backward 5NI; RoPE q and k read and written, forward and backward; the loss head's
  row pass reads and writes the (N, V) logits once (what any head built on cuBLAS GEMMs that write logits
  must move); AdamW reads p, g, m, v and writes p, m, v of every trainable parameter (bf16 states, the
  protocol's optimizer).
- Every other family (copies, elementwise, reductions) has floor 0: an ideal step has none.

The sum is a lower bound on the step under these ceilings, not an estimate: GEMMs rarely pass ~95% of the
measured rate and no kernel moves bytes faster than a copy.
"""

from __future__ import annotations

BF16 = 2


def lora_adapter_flops_per_token(cfg, r: int) -> float:
    """FLOPs per token of rank-``r`` adapters on all 7 projections: 2r(in + out) forward, 4r(in + out) backward."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    in_out = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # q, k, v, o, gate, up, down
    return 6 * r * in_out * cfg.num_hidden_layers


def step_floors_ms(cfg, rows: int, seq: int, method: str, peak_tflops: float, copy_tb_s: float,
                   lora_r: int | None = None) -> dict[str, float]:
    """Floor in ms of each op family for one step of ``rows`` x ``seq`` tokens (keys match profile_step's).

    cfg: a ModelConfig; method "full" or "lora" (rank ``lora_r`` on the 7 projections, the protocol's by default);
    peak_tflops: the measured bf16 matmul rate; copy_tb_s: the measured copy bandwidth (bytes read + written per
    second / 1e12).
    """
    from ..train.metrics import matmul_params
    from .protocol import LORA_R

    lora_r = LORA_R if lora_r is None else lora_r

    if method not in ("full", "lora"):
        raise ValueError(f"step_floors_ms: method {method!r} is not 'full' or 'lora'")
    n, layers = rows * seq, cfg.num_hidden_layers
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    params = matmul_params(cfg)
    gemm = (6 if method == "full" else 4) * params * n
    trainable = params  # full: every matmul weight (embeddings tied or not: the norms' weights are noise)
    if method == "lora":
        gemm += lora_adapter_flops_per_token(cfg, lora_r) * n
        trainable = lora_adapter_flops_per_token(cfg, lora_r) // 6
    attention = (cfg.flops_per_token(seq) - 6 * params) * n  # the MFU formula's causal attention

    def at_peak(flops):
        return flops / (peak_tflops * 1e12) * 1e3

    def at_copy(nbytes):
        return nbytes / (copy_tb_s * 1e12) * 1e3

    return {
        "gemm": at_peak(gemm),
        "flash/attn": at_peak(attention),
        "rms_norm": at_copy((2 * layers + 1) * (2 + 3) * n * h * BF16),
        "swiglu": at_copy(layers * (3 + 5) * n * i * BF16),
        "rope": at_copy(layers * 2 * 2 * (q + kv) * n * BF16),
        "linear CE": at_copy(2 * n * v * BF16),
        "adam": at_copy(7 * trainable * BF16),
    }


def where_time_goes(families_ms: dict[str, float], floors_ms: dict[str, float], tokens: int) -> dict:
    """Measured vs floor per family (families without a floor get 0), their sums, and tokens/s at each."""
    names = list(dict.fromkeys([*floors_ms, *families_ms]))
    table = [{"family": f, "measured_ms": round(families_ms.get(f, 0.0), 2), "floor_ms": round(floors_ms.get(f, 0.0), 2),
              "gap_ms": round(families_ms.get(f, 0.0) - floors_ms.get(f, 0.0), 2)} for f in names]
    measured, floor = sum(families_ms.values()), sum(floors_ms.values())
    return {"families": sorted(table, key=lambda r: -r["gap_ms"]), "measured_ms": round(measured, 2),
            "floor_ms": round(floor, 2), "tokens_per_s_at_floor": round(tokens / floor * 1e3),
            "tokens_per_s_at_measured_kernels": round(tokens / measured * 1e3) if measured else None}
