"""Choosing between a Triton kernel and its pure-PyTorch reference twin.

Every op takes ``impl="auto" | "triton" | "torch"``. ``"auto"`` means: Triton when the tensor lives on
CUDA, the reference otherwise (CPU). Under ``TRITON_INTERPRET=1`` ``"triton"`` also runs on CPU tensors
(that is how the kernel tests run). The resolved choice is logged once per op; there is no silent
fallback: asking for ``"triton"`` where it cannot run raises with the fix.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("chronicals.ops")
_logged: set[tuple[str, str, str]] = set()
IMPLS = ("auto", "triton", "torch")


# the values Triton's getenv_bool reads as on, any case (triton 3.7); tested against triton.knobs
_TRITON_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter, read as Triton reads TRITON_INTERPRET: a test for "1"
    alone refused impl="triton" on CPU under TRITON_INTERPRET=true (a mutation walk). os.environ, not
    triton.knobs: Dynamo cannot trace knobs' C getenv, and ops call this inside torch.compile'd code."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRITON_TRUE


def check_impl(op: str, impl: str, device: torch.device | None = None) -> str:
    """ValueError unless ``impl`` is one of IMPLS and, with a ``device``, can run there -> "triton" | "torch"
    (what "auto" means on that device; "auto" itself without one). Logs nothing: ``resolve_impl`` does."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is not one of {IMPLS} (auto: Triton on CUDA, PyTorch elsewhere)")
    if device is None:
        return impl
    chosen = ("triton" if device.type == "cuda" else "torch") if impl == "auto" else impl
    if chosen == "triton" and device.type != "cuda" and not triton_interpreting():
        raise ValueError(  # a setting this machine cannot run: the CLI prints it as one error line
            f"{op}: impl='triton' needs a CUDA tensor (got {device.type}); "
            "use impl='torch' (model.impl=torch) on CPU, or set TRITON_INTERPRET=1 to run the kernel in Triton's "
            "interpreter"
        )
    return chosen


def resolve_impl(op: str, impl: str, device: torch.device) -> str:
    """Return "triton" or "torch" for ``op`` on ``device``; log the choice once."""
    chosen = check_impl(op, impl, device)
    key = (op, impl, device.type)
    # logging inside a torch.compile'd graph breaks fullgraph=True; the eager first call logs instead. The
    # is_compiling() test comes first: read while tracing, _logged became a guard, and every op first logged
    # later in eager code recompiled the frame (one of the guards that took model.compile's decoder layer past
    # dynamo's recompile limit)
    if not torch.compiler.is_compiling() and key not in _logged:
        _logged.add(key)
        log.info("%s: impl=%s resolved to %s on %s", op, impl, chosen, device.type)
    return chosen
