"""Where a training step's memory goes: bytes held after each decoder sub-module's forward (what it saves for
backward), per layer, at a protocol shape, for the full and LoRA steps the bench times (eager: the same saved
tensors as the graphed step, which adds its pool).

    PYTHONPATH=src python benchmarks/probe_step_memory.py --shape 0.5b --out DIR

Per method: the weights and optimizer state before the step, each sub-module's growth of memory_allocated in a
middle layer (input_layernorm, self_attn, post_attention_layernorm, mlp: what each keeps for backward, plus its
output while the next one runs), the whole layer's steady growth, the growth of the loss head, and the peak of
forward + backward.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from chronicals.bench.contenders import get_contender
from chronicals.bench.protocol import RunSpec, make_batches
from chronicals.bench.shapes import get_shape
from common import require_cuda

MIB = 2 ** 20


def probe(method: str, shape_name: str, device: torch.device) -> dict:
    sh = get_shape(shape_name)  # the shape's own rows x seq (RunSpec's defaults are 0.5B's 16 x 1024: --shape 8b
    # measured 16 x 1024, not its 4 x 2048; a bench walk)
    spec = RunSpec(contender=f"chronicals-{method}", shape=shape_name, device=str(device),
                   **({"rows": sh.rows, "seq": sh.seq} if device.type == "cuda" else {"rows": 2, "seq": 32}))
    cuda = device.type == "cuda"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)  # a CPU dry run checks the calls only
    peak_of = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = get_shape(shape_name)
    built = get_contender(f"chronicals-{method}").build(spec, shape, device)
    model = built.model
    ids = make_batches(spec, built.vocab_size, 1, device)[0]
    batch = built.prepare(ids)
    # one step first: the optimizer's state exists from then on, as in a timed step
    built.forward_backward(batch)
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    sync()
    base = allocated()
    layers = model.model.layers
    mid = len(layers) // 2
    marks: list[tuple[str, int]] = []

    def mark(name):
        def hook(*_):
            sync()
            marks.append((name, allocated()))
        return hook

    handles = []
    for i in sorted({max(mid - 1, 0), mid, min(mid + 1, len(layers) - 1)}):
        handles.append(layers[i].register_forward_pre_hook(mark(f"L{i} start")))
    for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
        handles.append(getattr(layers[mid], sub).register_forward_hook(mark(f"L{mid} {sub}")))
    handles.append(model.model.norm.register_forward_pre_hook(mark("final norm start")))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.train()
    loss = model(batch.input_ids, position_ids=batch.position_ids, cu_seqlens=batch.cu_seqlens,
                 max_seqlen=batch.max_seqlen, shift_labels=batch.shift_labels, reduction="mean")
    sync()
    after_fwd, fwd_peak = allocated(), peak_of()
    loss.backward()
    sync()
    peak = peak_of()
    for h in handles:
        h.remove()
    built.optimizer.zero_grad(set_to_none=True)
    d = dict(marks)
    subs = {}
    prev = d[f"L{mid} start"]
    for sub in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
        now = d[f"L{mid} {sub}"]
        subs[sub] = round((now - prev) / MIB, 1)
        prev = now
    return {"method": method, "shape": shape_name, "tokens": spec.rows * spec.seq,
            "weights_and_state_mib": round(base / MIB, 1),
            "layer_mib": round((d.get(f"L{mid + 1} start", d["final norm start"]) - d[f"L{mid} start"]) / MIB, 1),
            "sub_mib": subs,
            "layers_total_mib": round((d["final norm start"] - d[f"L{max(mid - 1, 0)} start"]) / MIB * len(layers) /
                                      (len(layers) - max(mid - 1, 0)), 1),
            "after_forward_mib": round((after_fwd - base) / MIB, 1),
            "forward_peak_mib": round((fwd_peak - base) / MIB, 1),
            "step_peak_gib": round(peak / 2 ** 30, 2), "notes": built.notes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--methods", default="lora,full")
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cuda; cpu: a dry run of the calls (memory reads 0)")
    a = ap.parse_args()
    require_cuda(__file__)
    rows = []
    for m in a.methods.split(","):
        rows.append(probe(m, a.shape, torch.device(a.device)))
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / f"probe_step_memory_{a.shape}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
