"""Mutation testing (session 27): a cached safetensors file longer than its header says (bytes after the tensors, as a
copy into an existing larger file leaves) is damage: safetensors refuses to load it, so the entry is converted again."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from chronicals.models import gguf_cache


def test_trailing_bytes_after_the_tensors_are_damage(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4, 4)}, str(f))
    assert gguf_cache._damage(tmp_path) is None  # intact
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    why = gguf_cache._damage(tmp_path)
    assert why is not None and "model.safetensors" in why
