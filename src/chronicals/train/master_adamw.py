"""AdamW over fp32 master copies of bf16 (or fp16) weights: small updates accumulate instead of rounding away.

Why: a bf16 weight keeps 8 significant bits, so an AdamW step smaller than half its spacing (between |w| x 2^-9
and |w| x 2^-8: 0.0039 up from an RMSNorm weight of 1.0, 0.00195 down) rounds back to the same bf16 value. AdamW's
steps are about lr, so at lr=2e-5 plain AdamW on bf16 weights left 70% of the non-embedding weights of a full
fine-tune and every RMSNorm weight unchanged after 10 steps (fp32 weights: all of them moved). Here the update
runs on an fp32 copy (the master) and the bf16 parameter is the master rounded to nearest after every step.

Cost against torch AdamW on bf16 weights (whose moments are bf16): 8 bytes per trainable parameter (the fp32
master 4, fp32 moments 4 more), 4 GB at Qwen2.5-0.5B's 494M; during the step an fp32 copy of one slice's
gradients (``_SLICE`` elements, or the largest tensor when bigger).

The optimizer's ``param_groups`` hold the model's own parameters, so LR schedulers, ``param_groups[i]["lr"]``
and code that rewrites group hyperparameters (train/resume.py) work as with ``torch.optim.AdamW``.

    opt = MasterWeightAdamW(model.parameters(), lr=2e-5, weight_decay=0.1, fused=True)  # CUDA: torch's kernel
    loss.backward(); opt.found_inf = skip_flag  # optional, 0-dim float on the device: 1.0 skips the update
    opt.step()                                  # masters updated, then copied (rounded) into the bf16 params
"""

from __future__ import annotations

from collections import defaultdict
from itertools import chain

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .distributed import numel_runs

# Elements updated per fused call: bounds the transient fp32 gradient copy at 256 MiB (plus one tensor larger
# than that, e.g. a 151936 x 896 embedding = 136M elements = 545 MB) instead of 4 bytes x every parameter
# (2 GB at 0.5B); about 8 calls at 494M parameters, each a multi-tensor kernel.
_SLICE = 1 << 26
LOW_PRECISION = (torch.bfloat16, torch.float16)  # dtypes that get an fp32 master; float32 params are their own master


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) on fp32 masters of bf16/fp16 parameters.

    Per-parameter state: ``master`` (fp32 copy of the weight, made at its first step from the parameter; none
    for float32 parameters, which are updated in place), ``exp_avg``, ``exp_avg_sq`` (fp32, the parameter's
    shape), ``step`` (0-dim fp32 tensor on the parameter's device, as torch's fused AdamW keeps it).

    ``fused=True`` runs ``torch._fused_adamw_`` (torch ships it for CUDA and CPU, among others); ``False`` runs
    ``torch._foreach_*`` ops. Both honour ``optimizer.found_inf`` (a 0-dim float tensor: 1.0 leaves masters,
    moments, step counts and parameters untouched) without reading it on the host.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, fused: bool = False):
        if not (isinstance(lr, float | int) and lr >= 0):
            raise ValueError(f"MasterWeightAdamW: lr={lr!r} must be a number >= 0 (a tensor lr is not supported)")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"MasterWeightAdamW: betas={betas!r} must be two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"MasterWeightAdamW: eps={eps!r} must be > 0 (AdamW divides by sqrt(v) + eps)")
        if not weight_decay >= 0:
            raise ValueError(f"MasterWeightAdamW: weight_decay={weight_decay!r} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      fused=bool(fused)))
        for p in chain.from_iterable(g["params"] for g in self.param_groups):
            if p.dtype not in (*LOW_PRECISION, torch.float32):
                raise ValueError(f"MasterWeightAdamW: a parameter of dtype {p.dtype} (shape {tuple(p.shape)}): it "
                                 "keeps fp32 masters of bfloat16/float16 weights (float32 ones update in place); "
                                 "use torch.optim.AdamW for other dtypes")
            if fused and p.device.type not in _get_fused_kernels_supported_devices():
                raise ValueError(f"MasterWeightAdamW(fused=True): torch has no fused AdamW kernel on "
                                 f"{p.device.type}; pass fused=False (optim.fused=false)")

    # ---- state ----
    def _state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if "master" not in st and p.dtype in LOW_PRECISION:  # also after resuming a checkpoint of a run without masters
            st["master"] = p.detach().to(torch.float32, copy=True)
        return st

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 master, or p itself (a float32 parameter, or one no step has updated yet): the trained value
        before its rounding to bf16, which the trainer writes into the final adapter."""
        return self.state.get(p, {}).get("master", p)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``Optimizer.load_state_dict``, but masters, moments and step counts stay fp32 (the base class
        casts floating state to the parameter's dtype, which would round the masters back to bf16)."""
        saved = state_dict["state"]
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        super().load_state_dict(state_dict)
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params):  # the base class mapped them in this order (lengths checked)
            for key, value in saved.get(pid, {}).items():
                if key in ("master", "exp_avg", "exp_avg_sq", "step") and isinstance(value, torch.Tensor):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
            if "master" in self.state[p] and p.dtype not in LOW_PRECISION:
                del self.state[p]["master"]  # a float32 parameter is its own master

    # ---- update ----
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step on every parameter with a gradient. ``closure``: re-evaluates the loss (optional)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by the training loop (or a GradScaler) before step()
        for group in self.param_groups:
            by_device = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("MasterWeightAdamW does not support sparse gradients")
                    by_device[p.device].append(p)
            for device, params in by_device.items():
                skip = None if found_inf is None else found_inf.to(device=device, dtype=torch.float32,
                                                                    non_blocking=True)
                for part in numel_runs(params, _SLICE):
                    self._update(group, part, skip)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor], skip: torch.Tensor | None) -> None:
        states = [self._state(p) for p in params]
        targets = [st.get("master", p) for p, st in zip(params, states)]  # fp32: the master or the param itself
        grads = _fp32_grads(params)
        exp_avgs = [st["exp_avg"] for st in states]
        exp_avg_sqs = [st["exp_avg_sq"] for st in states]
        steps = [st["step"] for st in states]
        beta1, beta2 = group["betas"]
        args = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"])
        if group["fused"]:
            _fused_adamw(targets, grads, exp_avgs, exp_avg_sqs, steps, *args, skip)
        else:
            _foreach_adamw(targets, grads, exp_avgs, exp_avg_sqs, steps, *args, skip)
        low = [(p, st["master"]) for p, st in zip(params, states) if "master" in st]
        if low:  # round to nearest (copy_'s cast); after a skipped step the masters are unchanged: a no-op
            torch._foreach_copy_([p for p, _ in low], [m for _, m in low])


def _fp32_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The params' gradients in fp32: float32 ones as they are (only read), others cast into views of one
    flat buffer (one allocation and one multi-tensor copy instead of a cast per tensor)."""
    out = [p.grad for p in params]
    low = [i for i, p in enumerate(params) if p.grad.dtype != torch.float32]
    if low:
        flat = torch.empty(sum(params[i].numel() for i in low), dtype=torch.float32, device=params[low[0]].device)
        views = [v.view(params[i].shape) for v, i in zip(flat.split([params[i].numel() for i in low]), low)]
        torch._foreach_copy_(views, [params[i].grad for i in low])
        for i, v in zip(low, views):
            out[i] = v
    return out


def _fused_adamw(targets, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps, skip) -> None:
    """torch's fused AdamW kernel on fp32 lists; ``skip`` (found_inf) makes the kernel return early, and the step
    count it was given is taken back (as torch.optim.adam._fused_adam does)."""
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(targets, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1,
                        beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False, grad_scale=None,
                        found_inf=skip)
    if skip is not None:
        torch._foreach_sub_(steps, [skip] * len(steps))


def _foreach_adamw(targets, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, weight_decay, eps,
                   skip) -> None:
    """AdamW with multi-tensor ops; the step counts stay on the device (bias corrections as tensors, no host
    read). With ``skip`` the new values are computed and the old ones selected where skip is set: the old
    values are kept bit for bit whatever the gradients hold (inf, NaN)."""
    if skip is not None:
        before = [[t.clone() for t in ts] for ts in (targets, exp_avgs, exp_avg_sqs)]
    torch._foreach_add_(steps, 1)
    if weight_decay:
        torch._foreach_mul_(targets, 1 - lr * weight_decay)  # decoupled: w <- w (1 - lr wd), before the Adam step
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)  # m <- b1 m + (1 - b1) g
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)  # v <- b2 v + (1 - b2) g^2
    if lr:  # w <- w - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), t a device tensor per parameter
        bc1 = torch._foreach_pow(beta1, steps)
        torch._foreach_neg_(bc1)
        torch._foreach_add_(bc1, 1)  # 1 - b1^t
        bc2_sqrt = torch._foreach_pow(beta2, steps)
        torch._foreach_neg_(bc2_sqrt)
        torch._foreach_add_(bc2_sqrt, 1)
        torch._foreach_sqrt_(bc2_sqrt)  # sqrt(1 - b2^t)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_mul_(denom, bc1)
        torch._foreach_div_(denom, -lr)  # -(1 - b1^t) (sqrt(v_hat) + eps) / lr
        torch._foreach_addcdiv_(targets, exp_avgs, denom)
    if skip is not None:
        skipped = skip != 0
        for new_list, old_list in zip((targets, exp_avgs, exp_avg_sqs), before):
            for new, old in zip(new_list, old_list):
                new.copy_(torch.where(skipped, old, new))
        torch._foreach_sub_(steps, [skip] * len(steps))
