"""resolve_impl inside torch.compile: the choice is traced, its once-per-op log set is not guarded on."""

import torch
from torch._dynamo.testing import CompileCounter

from chronicals.ops import _impl


def test_logging_an_op_later_does_not_recompile(monkeypatch):
    monkeypatch.setattr(_impl, "_logged", set())
    torch._dynamo.reset()
    counter = CompileCounter()

    @torch.compile(backend=counter)
    def f(x):
        return x + 1 if _impl.resolve_impl("test_op_a", "auto", x.device) == "torch" else x - 1

    x = torch.ones(3)
    _impl.resolve_impl("test_op_a", "auto", x.device)  # the eager first call logs it
    assert torch.equal(f(x), x + 1) and counter.frame_count == 1
    _impl.resolve_impl("test_op_b", "auto", x.device)  # another op logged in eager code between two calls
    assert torch.equal(f(x), x + 1)
    assert counter.frame_count == 1, "the compiled frame was recompiled: dynamo guarded on resolve_impl's log set"
    torch._dynamo.reset()
