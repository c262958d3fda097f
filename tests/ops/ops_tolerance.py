"""The yardstick of the op tests: our error against a float64 reference, measured against PyTorch's own
error in the same dtype."""

import torch

# Two correct fp32 summation orders of one reduction differ by a few fp32 ulps, and PyTorch's CPU order depends on
# its thread count: on the fused loss head's d_hidden at (7, 96, 1031), torch's own fp32 error was 1.46e-7 with one
# thread and 5.09e-7 with two, against ours 4.79e-7 either way (max |d_hidden| 0.38). So the floor holds 4 fp32 ulps
# of the output's scale besides one ulp of the dtype: an order's luck is not a bug. It adds 4.8e-7 to a bf16 floor of
# 7.8e-3, nothing there; a real fp32 bug (a bf16 or fp16 accumulation, a lost term) is off by >= 1e-4.
ORDER_ULPS = 4


def assert_tracks_torch(name, ours, torch_same_dtype, ref64, k=2.0, dtype=None):
    """Our error vs fp64 <= k x PyTorch's error in the same dtype vs fp64 + (eps(dtype) + 4 eps(fp32)) x max|ref|
    (max|ref| at least 1).

    dtype: whose eps sets the floor (default: ours'). The loss head passes its inputs' dtype: the fp32 loss
    of bf16 inputs is a function of bf16-rounded logits, so one bf16 ulp of the loss is the floor below
    which two correct orders of rounding cannot be told apart.
    """
    err = (ours.double() - ref64).abs().max().item()
    torch_err = (torch_same_dtype.double() - ref64).abs().max().item()
    eps = torch.finfo(dtype or ours.dtype).eps + ORDER_ULPS * torch.finfo(torch.float32).eps
    atol = eps * max(ref64.abs().max().item(), 1.0)
    assert err <= k * torch_err + atol, f"{name}: error {err:.3g} vs torch {torch_err:.3g} (atol {atol:.3g})"
