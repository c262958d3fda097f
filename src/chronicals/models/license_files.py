"""What a model written from a base carries of the base's license (``chronicals export``).

- A Hugging Face directory: its LICENSE, LICENSE.txt, LICENSE.md, NOTICE, NOTICE.txt and NOTICE.md, in any case,
  copied as they are (read through symlinks: a Hub cache's snapshot links each file to a blob).
- A .gguf file: the license its metadata records (``general.license``, ``general.license.name``,
  ``general.license.link``) as the front matter of a README.md model card (``license``, ``license_name``,
  ``license_link``), where the Hugging Face Hub and ``huggingface_hub.ModelCard`` read a model's license. llama.cpp's
  convert_hf_to_gguf.py fills those GGUF keys from that very front matter, so this is the way back; a GGUF holds
  no license text to copy.

The files come back as name -> bytes for ``save_model(..., extra_files=)``, which writes them in the model's own
temporary directory (the license is in place when the directory appears, never after).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

LICENSE_NAME = re.compile(r"(?:license|notice)(?:\.txt|\.md)?", re.IGNORECASE)  # matched against a whole name
MODEL_CARD = "README.md"
# front matter key -> GGUF metadata key (llama.cpp's gguf-py Metadata: license, license_name, license_link)
_GGUF_KEYS = {"license": "general.license", "license_name": "general.license.name",
              "license_link": "general.license.link"}


def license_files(base: str | os.PathLike) -> dict[str, bytes]:
    """name -> bytes of the files that carry the license of the model ``base`` (an HF directory, a .gguf file or a
    short name) into a model written from it; {} when it records none. The names sort case-insensitively."""
    from .loading import resolve_path

    p = resolve_path(base)
    if p.is_file():
        return gguf_model_card(p)
    found = sorted((f for f in p.iterdir() if LICENSE_NAME.fullmatch(f.name) and f.is_file()),
                   key=lambda f: (f.name.lower(), f.name))
    return {f.name: f.read_bytes() for f in found}


def gguf_model_card(gguf_path: Path) -> dict[str, bytes]:
    """{"README.md": a model card whose front matter holds the license the GGUF's metadata records}, or {} when it
    records none. The card names the file, not its folder (a path in a card uploaded with the model tells where it
    lay on the user's machine)."""
    from .gguf_io import read_gguf_keys

    recorded = read_gguf_keys(gguf_path, set(_GGUF_KEYS.values()))
    front = {}
    for key, field in _GGUF_KEYS.items():
        value = recorded.get(field)
        if isinstance(value, str):
            if value.strip():
                front[key] = value
        elif value is not None:
            log.warning("%s: metadata %s=%r is not text; the export's README.md leaves it out: write the model's %s "
                        "into the written directory's README.md yourself", gguf_path, field, value, key)
    if "license" not in front:  # a name or link alone is no license to record
        return {}
    keys = ", ".join(_GGUF_KEYS[k] for k in front)
    # one line a value (width: safe_dump folds long ones at 80 columns), quoted where YAML needs it (": ", " #")
    matter = yaml.safe_dump(front, sort_keys=False, allow_unicode=True, width=float("inf"))
    card = (f"---\n{matter}---\n\nWritten by `chronicals export` from {gguf_path.name}; the license above is the one "
            f"that file's GGUF metadata records ({keys}).\n")
    return {MODEL_CARD: card.encode("utf-8")}


def describe(files: dict[str, bytes]) -> str:
    """What ``files`` (``license_files``' result) carry, for export's last line: "" for none."""
    if not files:
        return ""
    if MODEL_CARD in files:
        # the front matter ends at the first line that is "---" alone (huggingface_hub's rule); safe_dump indents
        # a value's continuation lines, so none of them is one
        front = yaml.safe_load(files[MODEL_CARD].decode("utf-8").removeprefix("---\n").split("\n---\n", 1)[0])
        return f", with the license of the base: {MODEL_CARD} (license: {front['license']}, from its GGUF metadata)"
    return f", with the license files of the base: {', '.join(files)}"
