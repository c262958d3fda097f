"""Probe (dev): packed-row attention through cuDNN's ragged (THD) SDPA graphs built with the cuDNN Python
frontend (``chronicals.ops.attention_cudnn``), against the varlen FlashAttention-2 path and dense cuDNN SDPA.

1. correctness on small cases vs a float64 block-diagonal reference (out, dq, dk, dv), next to FA2's error:
   GQA 8/2 x 64 and 8/2 x 128, documents ~60 tokens (fewer than the 16-document bucket: empty padded documents),
   exactly 16 documents, and > 16;
2. a CUDA-graph capture of forward + backward replayed with other cu_seqlens of the same bucket, against eager;
3. fwd and fwd+bwd times at the 0.5B (16 x 1024, 14/2 x 64) and 8B (4 x 2048, 32/8 x 128) shapes, one document
   per row and shorter documents, and the first call (graph build) time; eager times include the host's launch
   cost (the cuDNN path's Python execute), so fwd+bwd is also timed as a replayed CUDA graph (GPU time only).

    PYTHONPATH=src python benchmarks/probe_attention_cudnn_fe.py OUT.json
"""
import json
import sys
import time
import traceback

import torch
from triton.testing import do_bench

from bench_attention import packed_or_rows as cu_for
from common import kernel_ms, require_cuda
from chronicals.ops import attention_cudnn as ac
from chronicals.ops.attention import attention_ref, attention_varlen_flash

dev, bf = "cuda", torch.bfloat16


def grads(fn, q, k, v, g):
    ts = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*ts)
    out.backward(g)
    return [out.detach().double()] + [t.grad.double() for t in ts]


def check(res, gen):
    cases = [(3, 256, 8, 2, 64, 60), (3, 256, 8, 2, 128, 60), (4, 256, 8, 2, 64, 64), (8, 256, 14, 2, 64, 40)]
    ok = True
    for b, s, hq, hk, d, mean in cases:
        cu = cu_for(b, s, gen, mean)
        n = cu.numel() - 1
        maxs = int(cu.diff().max())
        q, k, v = (torch.randn(b, s, h, d, generator=gen).to(dev) for h in (hq, hk, hk))
        g = torch.randn(b, s, hq, d, generator=gen).to(dev)
        ref = grads(lambda *t: attention_ref(*t, cu_seqlens=cu), q.double(), k.double(), v.double(), g.double())
        row = {}
        for name, fn in (("fa2", lambda *t: attention_varlen_flash(*t, cu, maxs)),
                         ("cudnn", lambda *t: ac.attention_varlen_cudnn(*t, cu, maxs))):
            try:
                got = grads(fn, q.to(bf), k.to(bf), v.to(bf), g.to(bf))
                row[name] = [round(float((a - r).abs().max()), 5) for a, r in zip(got, ref)]
            except Exception as e:  # noqa: BLE001
                row[name] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
        if isinstance(row["cudnn"], str) or max(row["cudnn"]) > 2 * max(row["fa2"]) + 0.02:
            ok = False
        key = f"b{b} s{s} {hq}/{hk}x{d} docs={n}"
        res["check"][key] = row
        print("check", key, row, flush=True)
    return ok


def graph_check(res, gen):
    b, s, hq, hk, d = 4, 512, 14, 2, 64
    q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=bf, requires_grad=True) for h in (hq, hk, hk))
    g = torch.randn(b, s, hq, d, device=dev, dtype=bf)
    cap = 32
    cu_buf = torch.zeros(cap + 1, dtype=torch.int32, device=dev)

    def fill(cu):
        cu_buf[:cu.numel()].copy_(cu)
        cu_buf[cu.numel():].copy_(cu[-1:].expand(cap + 1 - cu.numel()))

    def step():
        out = ac.attention_varlen_cudnn(q, k, v, cu_buf, s)
        return torch.autograd.grad(out, (q, k, v), g) + (out,)

    cu0 = cu_for(b, s, gen, 100)
    fill(cu0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    errs = []
    for mean in (80, 150):
        cu = cu_for(b, s, gen, mean)
        if cu.numel() - 1 > cap:
            continue
        fill(cu)
        graph.replay()
        eager = step()
        errs.append(max(float((a.float() - e.float()).abs().max()) for a, e in zip(static, eager)))
    res["graph_replay_max_diff_vs_eager"] = errs
    print("graph replay max diff vs eager", errs, flush=True)


def chat_rows(b, s, gen, median=380.0, sigma=1.0):
    """Rows of s tokens cut into documents with bench_packing.py's chat-like lengths (lognormal, median 380,
    clipped to [16, what is left]), no padding: [(ids, trainable)] per row, loss on the second half."""
    import numpy as np
    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    rows = []
    for _ in range(b):
        docs, t = [], 0
        while t < s:
            n = int(np.clip(rng.lognormal(np.log(median), sigma), 16, s - t))
            n = s - t if s - t - n < 16 else n
            ids = rng.integers(0, 32000, n)
            trainable = np.zeros(n, bool)
            trainable[n // 2:] = True
            docs.append((ids, trainable))
            t += n
        rows.append(docs)
    return rows


def model_step(res, gen):
    """The 0.5B model's training step (trainer's step, CUDA graphs, full and LoRA) on chat-like packed rows:
    ms per step with each packed-rows kernel, the same batches."""
    from chronicals.bench.contenders import add_chronicals_lora, build_chronicals_model
    from chronicals.bench.protocol import RunSpec
    from chronicals.bench.shapes import get_shape
    from chronicals.data.collate import collate_rows
    from chronicals.train.graphs import GraphedStep
    from chronicals.train.step import accumulate_gradients
    batches = [collate_rows(chat_rows(16, 1024, gen), 1024, 0) for _ in range(4)]
    res["model_step_docs_per_batch"] = [bt.num_docs for bt in batches]
    for method in ("full", "lora"):
        for kernel in ("flash", "cudnn"):
            model = build_chronicals_model(get_shape("0.5b"), torch.device(dev), "auto", 0)
            if method == "lora":
                add_chronicals_lora(model, RunSpec("chronicals-lora-graphs"))
            model.opts.attention = kernel
            graphed = GraphedStep(model, torch.device(dev))
            for bt in batches[:3]:
                accumulate_gradients(model, [bt], torch.device(dev), graphed)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 0
            for i in range(12):
                bt = batches[i % len(batches)]
                accumulate_gradients(model, [bt], torch.device(dev), graphed)
                n += bt.num_loss_tokens
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            key = f"0.5b {method} graphs chat-packed {kernel}"
            res.setdefault("model_step", {})[key] = {"ms_per_step": round(dt / 12 * 1000, 2),
                                                     "loss_tokens_per_s": round(n / dt)}
            print(key, res["model_step"][key], flush=True)
            del model, graphed
            torch.cuda.empty_cache()


def timing(res, gen):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for tag, (b, s, hq, hk, d) in {"0.5b": (16, 1024, 14, 2, 64), "8b": (4, 2048, 32, 8, 128)}.items():
        for mean in ((None, 256, 64) if tag == "0.5b" else (None, 300)):
            cu = cu_for(b, s, gen, mean)
            maxs = int(cu.diff().max())
            q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=bf, requires_grad=True) for h in (hq, hk, hk))
            g = torch.randn(b, s, hq, d, device=dev, dtype=bf)
            fns = {"fa2 varlen": lambda: attention_varlen_flash(q, k, v, cu, maxs),
                   "cudnn ragged": lambda: ac.attention_varlen_cudnn(q, k, v, cu, maxs)}
            if mean is None:
                def dense():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                            enable_gqa=True).transpose(1, 2)
                fns["sdpa dense cudnn"] = dense
            base = None
            for name, fn in fns.items():
                key = f"{tag} docs={'row' if mean is None else mean} ({cu.numel() - 1}) {name}"
                try:
                    t0 = time.perf_counter()
                    out = fn()
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    got = torch.autograd.grad(out, (q, k, v), g) + (out,)
                    if base is None:
                        base, err = got, 0.0
                    else:
                        err = max(float((a.float() - r.float()).abs().max()) for a, r in zip(got, base))
                    fwd = do_bench(fn, warmup=10, rep=50)
                    both = do_bench(lambda: torch.autograd.grad(fn(), (q, k, v), g), warmup=10, rep=50)
                    kernels = kernel_ms(lambda: torch.autograd.grad(fn(), (q, k, v), g))
                    res["time"][key] = {"fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(both, 4),
                                        "fwd_bwd_gpu_kernels_ms": round(kernels, 4),
                                        "first_call_s": round(first, 3), "max_abs_diff_vs_fa2": round(err, 5)}
                except Exception as e:  # noqa: BLE001
                    res["time"][key] = f"{type(e).__name__}: {str(e)[:300]}"
                print(key, res["time"][key], flush=True)


def main(path):
    import cudnn
    res = {"torch": torch.__version__, "cudnn_backend": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__,
           "gpu": torch.cuda.get_device_name(), "check": {}, "time": {}}
    print(res, flush=True)
    gen = torch.Generator().manual_seed(0)
    res["correct"] = check(res, gen)
    for part in (graph_check, timing, model_step):
        try:
            part(res, gen)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res[part.__name__] = f"{type(e).__name__}: {str(e)[:400]}"
    json.dump(res, open(path, "w"), indent=1)


if __name__ == "__main__":
    require_cuda(__file__, "OUT.json")
    main(sys.argv[1])
