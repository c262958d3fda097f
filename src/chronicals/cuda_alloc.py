"""The CUDA caching allocator's setting chronicals' commands run with: expandable segments, unless the user chose.

PyTorch reads ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF`` in newer releases) once, when the process first
allocates CUDA memory, so the CLI sets it at its start, before anything touches the GPU. Expandable segments map
memory into segments that grow in place, instead of one fixed cudaMalloc per large request, which leaves less of a
CUDA graph's private pool unused between its blocks. Measured on an H200 (git a4de062, the 0.5B full fine-tune
with CUDA graphs, one call alternating the setting, ``ab_expseg_*``): peak 14.3 -> 13.9 GiB, 140,099 / 139,998 ->
140,170 / 140,443 tokens/s; the 8B LoRA step 40.2 -> 40.1 GiB (``expseg_8b_*``).

Library users who call ``train()`` from their own script set the variable themselves, before importing anything
that allocates on the GPU; a value already set (either name) is never replaced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT = "expandable_segments:True"


def allocator_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """{PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True} when ``environ`` (os.environ) sets neither variable,
    else {}."""
    environ = os.environ if environ is None else environ
    return {} if any(v in environ for v in VARIABLES) else {VARIABLES[0]: DEFAULT}


def allocator_setting(environ: Mapping[str, str] | None = None) -> str:
    """What this process's allocator runs with, for the log. Both variables set: both are named, since which one
    PyTorch reads then differs between releases (and between its readers within one)."""
    environ = os.environ if environ is None else environ
    named = [f"{v}={environ[v]}" for v in VARIABLES if v in environ]
    if not named:
        return "PyTorch's default (no PYTORCH_CUDA_ALLOC_CONF)"
    return named[0] if len(named) == 1 else f"{' and '.join(named)} (both set: PyTorch reads one of them)"
