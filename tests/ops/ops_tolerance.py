"""The yardstick of the op tests: our error against a float64 reference, measured against PyTorch's own
error in the same dtype."""

import torch


def assert_tracks_torch(name, ours, torch_same_dtype, ref64, k=2.0, dtype=None):
    """Our error vs fp64 <= k x PyTorch's error in the same dtype vs fp64 + eps(dtype) x max|ref|.

    dtype: whose eps sets the floor (default: ours'). The loss head passes its inputs' dtype: the fp32 loss
    of bf16 inputs is a function of bf16-rounded logits, so one bf16 ulp of the loss is the floor below
    which two correct orders of rounding cannot be told apart.
    """
    err = (ours.double() - ref64).abs().max().item()
    torch_err = (torch_same_dtype.double() - ref64).abs().max().item()
    atol = torch.finfo(dtype or ours.dtype).eps * max(ref64.abs().max().item(), 1.0)
    assert err <= k * torch_err + atol, f"{name}: error {err:.3g} vs torch {torch_err:.3g} (atol {atol:.3g})"
