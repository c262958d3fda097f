"""LoRA dropout on CUDA: the seeded masks (``ops.dropout``) through eager, torch.compile'd layers and a CUDA graph.

Checks, on a tiny Qwen2-shaped model in bf16 with the Triton ops: (1) compile_layers() with LoRA dropout traces
the Triton dropout kernel, gives about the eager loss for the same seed (inductor may draw other seeds) and the
same loss again from the same seed; (2) the fraction of elements a draw keeps;
(3) the kernel's time against a copy of the same bytes at the 0.5B down projection's shape (16,384 x 4,864).

Usage: PYTHONPATH=src python benchmarks/check_lora_dropout_cuda.py
"""

from __future__ import annotations

import torch
import triton
from common import require_cuda, wall_seconds_per_call

from chronicals.bench.contenders import build_chronicals_model, rows_as_packed_batch
from chronicals.bench.shapes import get_shape
from chronicals.lora import apply_lora
from chronicals.ops import dropout as D
from chronicals.train.step import accumulate_gradients

DEV = torch.device("cuda")


def model(compiled: bool):
    m = build_chronicals_model(get_shape("tiny"), DEV, "auto", seed=0).to(torch.bfloat16)
    apply_lora(m, r=4, alpha=8, dropout=0.1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if compiled:
        m.compile_layers()
    return m.train()


def main() -> None:
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = rows_as_packed_batch(ids, "rows")
    losses = {}
    for compiled in (False, True):
        m = model(compiled)
        torch.manual_seed(5)
        loss, _ = accumulate_gradients(m, [batch], DEV)
        losses[compiled] = loss.float().item()
    m.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # what a resume relies on: the compiled layers' masks follow torch's generator
    again = accumulate_gradients(m, [batch], DEV)[0].float().item()
    print(f"eager loss {losses[False]:.6f}  compiled loss {losses[True]:.6f}  compiled again from the seed {again:.6f}")
    assert abs(losses[True] - losses[False]) < 2e-2 * abs(losses[False]), losses
    assert again == losses[True], (again, losses)

    torch.manual_seed(0)
    d = D.draw(0.1, DEV)
    keep = D.keep_mask(d, 4096, 4864, DEV).float().mean().item()
    print(f"kept fraction {keep:.5f} (want {1 - d.p_applied:.5f})")
    assert abs(keep - (1 - d.p_applied)) < 1e-3
    assert torch.equal(D.keep_mask(d, 64, 4864, DEV), D.keep_mask(d, 64, 4864, DEV, impl="torch"))

    x = torch.randn(16384, 4864, device=DEV, dtype=torch.bfloat16)
    base = torch.randn_like(x)
    t_drop = triton.testing.do_bench(lambda: D.dropped(x, d))
    t_add = triton.testing.do_bench(lambda: D.add_dropped_(base, x, d))
    t_copy = triton.testing.do_bench(lambda: x.clone())
    t_old = triton.testing.do_bench(lambda: x * (torch.rand(x.shape, device=DEV) >= 0.1) * (1 / 0.9))
    gb = x.numel() * 2 / 1e9
    print(f"16384 x 4864 bf16: dropped {t_drop * 1e3:.1f} us ({2 * gb / t_drop:.1f} TB/s), add_dropped_ "
          f"{t_add * 1e3:.1f} us ({3 * gb / t_add:.1f} TB/s), clone {t_copy * 1e3:.1f} us, "
          f"torch.rand mask path {t_old * 1e3:.1f} us")
    # host cost per call (eager steps are host-bound): small tensors, a sync only at the end
    from chronicals.ops import swiglu
    small, sb = torch.randn(16, 896, device=DEV, dtype=torch.bfloat16), torch.randn(16, 896, device=DEV,
                                                                                   dtype=torch.bfloat16)

    def host_us(fn):
        return wall_seconds_per_call(fn, 2000, warmup=50) * 1e6

    print(f"host per call: draw {host_us(lambda: D.draw(0.1, DEV)):.1f} us, dropped {host_us(lambda: D.dropped(small, d)):.1f}"
          f" us, add_dropped_ {host_us(lambda: D.add_dropped_(sb, small, d)):.1f} us, raw kernel launch "
          f"{host_us(lambda: D._launch(small, sb, d, True)):.1f} us, swiglu fwd {host_us(lambda: swiglu(small, sb)):.1f}"
          f" us, torch.rand mask path {host_us(lambda: small * (torch.rand(small.shape, device=DEV) >= 0.1) * 1.1):.1f} us")
    print("OK")


if __name__ == "__main__":
    require_cuda(__file__)
    main()
