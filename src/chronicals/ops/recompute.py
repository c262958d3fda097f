"""Selective recomputation: tensors autograd would save are rebuilt in backward from tensors it keeps anyway.

Inside ``with recompute_session():`` (a ``torch.autograd.graph.saved_tensors_hooks`` context), a tensor
registered with ``offer(t, fn)`` is not kept alive by the autograd graph: each save of ``t`` (or of a view
of it, e.g. the 2-D ``reshape`` that ``F.linear`` saves) stores ``fn`` and the view's geometry instead, and
the first unpack in backward calls ``fn()`` once; the result is shared by every node that saved ``t`` and
dropped after the last of them unpacked it.

What it buys at the Qwen2.5-0.5B protocol (16 x 1024 tokens, 24 layers, bf16):
- each RMSNorm output (N, H), saved by q/k/v (or gate/up) for their weight / LoRA-A gradients, rebuilt
  from the norm's own saved input and rstd: 2 x 16384 x 896 x 2 B x 24 = 1.31 GiB for one pass of
  (read N x H, write N x H) per norm in backward (~14 us each on an H200, ~0.7 ms per step);
- the SwiGLU product (N, I), saved by down_proj, rebuilt from gate and up (which the SwiGLU backward
  keeps): 16384 x 4864 x 2 B x 24 = 3.56 GiB for one SwiGLU forward per layer (~0.11 ms, ~2.6 ms/step).
``fn`` must return bit-identical values (same kernel, same inputs), so gradients do not change at all;
the tests check it. ``fn`` runs under ``torch.no_grad()``.

Lifetime rules: an offer lives as long as ``t``'s Python object (a finalizer drops it), so a later
tensor reusing the same memory never matches a stale offer; saves are matched by storage pointer and
storage size. Offers made outside a session are ignored (no cost beyond a flag check). The tensors a recipe
holds (a ``functools.partial``'s arguments, a closure's cells) keep their version counters from the offer: one
changed in place before the rebuild is a RuntimeError, as autograd raises for a saved tensor.
Under ``torch.compile`` the session is not entered (the compiler plans its own recomputation).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch

_active = 0  # nesting depth of open sessions
_offers: dict[tuple[int, int], "_Offer"] = {}


def _inputs(fn) -> tuple[tuple[torch.Tensor, int], ...]:
    """(tensor, version) of each tensor ``fn`` holds: a functools.partial's arguments and a closure's cells,
    lists and tuples of tensors included (``partial(torch.cat, ws)``)."""
    held = []
    if isinstance(fn, functools.partial):
        held += [*fn.args, *fn.keywords.values()]
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    flat = [t for h in held for t in (h if isinstance(h, (list, tuple)) else (h,)) if isinstance(t, torch.Tensor)]
    out = []
    for t in flat:
        try:
            out.append((t, t._version))
        except RuntimeError:  # an inference-mode tensor has no version counter (and cannot be changed in place here)
            pass
    return tuple(out)


class _Offer:
    __slots__ = ("fn", "dtype", "inputs", "packs", "unpacks", "value", "__weakref__")

    def __init__(self, fn: Callable[[], torch.Tensor], dtype: torch.dtype):
        self.fn, self.dtype, self.packs, self.unpacks, self.value = fn, dtype, 0, 0, None
        self.inputs = _inputs(fn)

    def peek(self) -> torch.Tensor:
        """The rebuilt tensor, computed once and shared, without counting an unpack (see ``rebuilder``). An input
        of the recipe changed in place since the offer is a RuntimeError (autograd's own check on a saved tensor:
        the rebuilt value would be wrong, and so would every gradient that reads it)."""
        if self.value is None:
            for t, version in self.inputs:
                if t._version != version:
                    raise RuntimeError(
                        f"recompute: a tensor {tuple(t.shape)} {t.dtype} that backward needs to rebuild a saved "
                        f"activation was modified by an in-place operation after the forward (version {version} -> "
                        f"{t._version}); autograd raises the same for a saved tensor. Modify a clone instead, or "
                        "turn recomputation off (model.recompute: [], or no recompute_session)")
            with torch.no_grad():
                self.value = self.fn()
        return self.value

    def get(self) -> torch.Tensor:
        out = self.peek()
        self.unpacks += 1
        if self.unpacks >= self.packs:  # the last saver has it: let it go with that node
            self.value = None
        return out


class _Packed:
    """What the graph holds instead of a tensor: the offer and the saved view's geometry."""
    __slots__ = ("offer", "shape", "stride", "offset")

    def __init__(self, offer: _Offer, t: torch.Tensor):
        self.offer, self.shape, self.stride, self.offset = offer, t.shape, t.stride(), t.storage_offset()


def _key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def is_active() -> bool:
    return _active > 0


def offer(t: torch.Tensor, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Let saves of ``t`` be rebuilt by ``fn()`` in backward (same shape, dtype, values; contiguous).

    Returns ``t``. A no-op outside a session and under torch.compile. May be called inside an
    autograd.Function's forward (where grad mode is off): an offer nobody saves costs a dict entry.
    """
    if not _active or torch.compiler.is_compiling():
        return t
    if not t.is_contiguous() or t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        raise ValueError("recompute.offer: offer a tensor that owns its whole storage (contiguous, offset 0): "
                         "its saved views are rebuilt from a fresh contiguous recomputation")
    key = _key(t)
    _offers[key] = entry = _Offer(fn, t.dtype)
    ref = weakref.ref(entry)
    weakref.finalize(t, _drop, key, ref)
    return t


def rebuilder(t: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """When ``t`` is offered in the open session: a zero-argument function that returns its rebuilt value in
    backward (computed once, shared with the graph's own unpacks of ``t``); else None.

    For a recipe built from another offered tensor: ``offer(u, lambda: f(src()))`` with ``src = rebuilder(t)``
    does not hold ``t`` itself alive (a closure over ``t`` would).
    """
    if not _active or torch.compiler.is_compiling():
        return None
    entry = _offers.get(_key(t))
    return None if entry is None or entry.dtype != t.dtype else entry.peek


def _drop(key, ref):
    if _offers.get(key) is not None and _offers[key] is ref():
        del _offers[key]


def _pack(t: torch.Tensor):
    if not _offers or t.layout != torch.strided:
        return t
    entry = _offers.get(_key(t))
    if entry is None or t.dtype != entry.dtype:
        return t
    entry.packs += 1
    return _Packed(entry, t)


def _unpack(p):
    if not isinstance(p, _Packed):
        return p
    full = p.offer.get()
    return full.as_strided(p.shape, p.stride, p.offset)


@contextlib.contextmanager
def recompute_session(enabled: bool = True):
    """Open a session (see the module docstring); ``enabled=False`` is a plain no-op context."""
    global _active
    if not enabled or torch.compiler.is_compiling():
        yield
        return
    _active += 1
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _active -= 1
        if not _active:
            _offers.clear()
