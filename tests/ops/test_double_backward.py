"""A double backward (create_graph=True: a gradient penalty, a Hessian-vector product) through the Triton kernels'
eager doors raises, instead of handing back a first gradient with no graph that the second backward took as a
constant (rms_norm's second-order gradient was off by 7.2, swiglu's by 4.3, without a word). impl="torch" stays
twice differentiable."""

import pytest
import torch

from chronicals.ops import rms_norm, rope_qk, swiglu, swiglu_gate_up

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cases():
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DEV)

    w, u, cos, sin = r(8), r(3, 8), r(1, 3, 4).cos(), r(1, 3, 4).sin()
    k = r(1, 3, 2, 4)
    return {
        "rms_norm": (r(3, 8), lambda x, impl: rms_norm(x, w, 1e-6, impl=impl)),
        "rms_norm_residual": (r(3, 8), lambda x, impl: rms_norm(x, w, 1e-6, residual=u, impl=impl)[0]),
        "swiglu": (r(3, 8), lambda x, impl: swiglu(x, u, impl=impl)),
        "swiglu_gate_up": (r(3, 8), lambda x, impl: swiglu_gate_up(x, impl=impl)),
        "rope_qk": (r(1, 3, 2, 4), lambda x, impl: rope_qk(x, k, cos, sin, impl=impl)[0]),
    }


@pytest.mark.parametrize("op", sorted(_cases()))
def test_double_backward_raises_under_triton_and_works_under_torch(op):
    x0, f = _cases()[op]
    for impl in ("torch", "triton"):
        x = x0.clone().requires_grad_()
        (gx,) = torch.autograd.grad((f(x, impl) ** 3).sum(), x, create_graph=True)
        if impl == "torch":
            (gx * x).sum().backward()
            assert x.grad is not None and x.grad.abs().sum() > 0
        else:
            with pytest.raises(RuntimeError, match="differentiate twice"):
                (gx * x).sum().backward()
