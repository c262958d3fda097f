"""Small helpers shared by the Triton ops: autotune config lists, SM counts, launch checks."""

from __future__ import annotations

import functools
import os

import torch
import triton

from ._impl import triton_interpreting


def tune_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """The config list for ``triton.autotune``: all of them on CUDA, only the first under TRITON_INTERPRET=1
    (each extra config would run the interpreted kernel once more for nothing) or with CHRONICALS_AUTOTUNE=first
    set before chronicals is imported: GPU test runs, where every new shape of every test compiled and timed each
    config (a 170 s call spent its time autotuning one op's tests on the H200). Never for timing runs."""
    mode = os.environ.get("CHRONICALS_AUTOTUNE", "all")
    if mode not in ("all", "first"):
        raise ValueError(f"CHRONICALS_AUTOTUNE={mode!r}: use 'all' (the default: autotune every config) or 'first' "
                         "(one config per kernel, for quick GPU test runs)")
    return configs[:1] if triton_interpreting() or mode == "first" else configs


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H100/H200); 4 on the CPU interpreter (small grids)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_device(op: str, *tensors: torch.Tensor) -> None:
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devs))}")
