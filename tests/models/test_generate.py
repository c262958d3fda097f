"""models.generate on tiny random models: the arguments it refuses, and where it stops."""

import re

import pytest
import torch

from chronicals.models import CausalLM, ModelConfig, generate


def _model(tiny_hf_config, family="qwen3", **overrides) -> CausalLM:
    return CausalLM(ModelConfig.from_hf_dict(tiny_hf_config(family, **overrides))).init_weights(std=0.5, seed=0).eval()


@pytest.mark.parametrize("shape", [(2, 9), (1, 1, 9), (0,)])
def test_refuses_what_is_not_one_prompt(tiny_hf_config, shape):
    """A (2, 9) batch was read as one 18-token prompt (view(1, -1)): the rows ran into each other and the answer
    continued the second row as if the first came before it; an empty prompt failed with a bare IndexError."""
    model = _model(tiny_hf_config)
    ids = torch.randint(3, 97, shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=re.escape(f"one prompt, input_ids (S,) or (1, S) with S >= 1, got shape "
                                                   f"{tuple(shape)}")):
        generate(model, ids, 4)
