"""What a model written from a base carries of the base's license (``chronicals export``).

- A Hugging Face directory: its LICENSE, LICENSE.txt, LICENSE.md, NOTICE, NOTICE.txt and NOTICE.md, in any case,
  copied as they are (read through symlinks: a Hub cache's snapshot links each file to a blob); and the license its
  README.md's front matter names (``license``, ``license_name``, ``license_link``: where the Hub reads it, and often
  the only place a Hub folder says it) as the front matter of a new README.md model card (the base's card text
  describes the base, so it is not copied).
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
    return {f.name: f.read_bytes() for f in found} | readme_model_card(p)


def readme_model_card(base_dir: Path) -> dict[str, bytes]:
    """{"README.md": a model card whose front matter holds the license the base directory's own README.md front
    matter records (license, license_name, license_link)}, or {}. A Hub folder often says its license there alone
    (SmolLM2's has no LICENSE file); its card's text describes the base, not the written model, so only those keys
    are carried. Read by huggingface_hub's own front-matter reader; a card it cannot read is warned of and left."""
    from huggingface_hub.repocard import metadata_load

    readme = base_dir / MODEL_CARD
    if not readme.is_file():
        return {}
    try:
        recorded = metadata_load(readme) or {}
    except (ValueError, UnicodeDecodeError, yaml.YAMLError) as e:
        log.warning("%s: its front matter cannot be read (%s); the license it may name is not carried into the "
                    "export: write it into the written directory's README.md yourself", readme, e)
        return {}
    return _card({key: recorded.get(key) for key in _GGUF_KEYS}, readme,
                 f"{base_dir.name}/{MODEL_CARD}; the license above is the one its front matter records")


def gguf_model_card(gguf_path: Path) -> dict[str, bytes]:
    """{"README.md": a model card whose front matter holds the license the GGUF's metadata records}, or {} when it
    records none. The card names the file, not its folder (a path in a card uploaded with the model tells where it
    lay on the user's machine)."""
    from .gguf_io import read_gguf_keys

    recorded = read_gguf_keys(gguf_path, set(_GGUF_KEYS.values()))
    front = {key: recorded.get(field) for key, field in _GGUF_KEYS.items()}
    keys = ", ".join(_GGUF_KEYS[k] for k, v in front.items() if isinstance(v, str) and v.strip())
    return _card(front, gguf_path, f"{gguf_path.name}; the license above is the one that file's GGUF metadata "
                                   f"records ({keys})")


def _card(front: dict, source: Path, written_from: str) -> dict[str, bytes]:
    """{"README.md": the card of ``front``'s text values (license, license_name, license_link)} or {} without a
    license (a name or link alone is no license to record); a value that is not text is warned of and left out."""
    kept = {}
    for key, value in front.items():
        if isinstance(value, str):
            if value.strip():
                kept[key] = value
        elif value is not None:
            log.warning("%s: its %s=%r is not text; the export's README.md leaves it out: write the model's %s "
                        "into the written directory's README.md yourself", source, key, value, key)
    if "license" not in kept:
        return {}
    # one line a value (width: safe_dump folds long ones at 80 columns), quoted where YAML needs it (": ", " #")
    matter = yaml.safe_dump(kept, sort_keys=False, allow_unicode=True, width=float("inf"))
    return {MODEL_CARD: f"---\n{matter}---\n\nWritten by `chronicals export` from {written_from}.\n".encode("utf-8")}


def describe(files: dict[str, bytes], base: str | os.PathLike) -> str:
    """What ``files`` (``license_files(base)``'s result) carry, for export's last line: "" for none."""
    from .loading import resolve_path

    if not files:
        return ""
    if MODEL_CARD not in files:
        return f", with the license files of the base: {', '.join(files)}"
    # the front matter ends at the first line that is "---" alone (huggingface_hub's rule); safe_dump indents a
    # value's continuation lines, so none of them is one
    front = yaml.safe_load(files[MODEL_CARD].decode("utf-8").removeprefix("---\n").split("\n---\n", 1)[0])
    card = (f"{MODEL_CARD} (license: {front['license']}, from "
            f"{'its GGUF metadata' if resolve_path(base).is_file() else 'its README.md front matter'})")
    others = [n for n in files if n != MODEL_CARD]
    return (f", with the license files of the base: {', '.join(others)}, and {card}" if others else
            f", with the license of the base: {card}")
