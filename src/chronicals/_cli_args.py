"""The argument parser of the chronicals commands (export, chat, eval, bench). A leaf: imports nothing of ours."""

from __future__ import annotations

import argparse


class _StoreOnce(argparse._StoreAction):
    """argparse's "store" that refuses an option given twice (the last one silently won), as the config refuses a
    key given twice."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            if self.dest in parser.given:
                parser.error(f"{'/'.join(self.option_strings)} was given twice; give it once")
            parser.given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """The ArgumentParser of a chronicals command: each value option may be given once (``_StoreOnce``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: set[str] = set()  # dests given in the parse under way
        self.register("action", "store", _StoreOnce)
        self.register("action", None, _StoreOnce)  # add_argument without action= looks up None

    def parse_known_args(self, args=None, namespace=None):
        self.given = set()
        return super().parse_known_args(args, namespace)
