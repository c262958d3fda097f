"""`chronicals bench`: the ANCHORS.md end-to-end protocol, every contender side by side, with proof of training.

``main(argv)`` is the command (see ``cli``); ``worker`` runs one contender per process; ``protocol``
holds the timing loop and row validation; ``contenders`` / ``unsloth_contender`` build each contender;
``checks`` holds the parity and learning checks; ``report`` writes JSON, markdown and PNG.
Nothing here imports transformers at import time (Unsloth must be imported before it).
"""


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)


__all__ = ["main"]
