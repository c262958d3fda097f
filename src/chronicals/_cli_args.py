"""The argument parser of the chronicals commands (export, chat, eval, bench). A leaf: imports nothing of ours."""

from __future__ import annotations

import argparse


class _StoreOnce(argparse._StoreAction):
    """argparse's "store" that notes an option given twice (the last one silently won); ``Parser`` refuses it once
    the parse is done, as the config refuses a key given twice."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            if self.dest in parser.given:
                parser.repeated.append(self)
            parser.given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """The ArgumentParser of a chronicals command: each value option may be given once (``_StoreOnce``). The refusal
    comes after the parse, so a --help anywhere on the line still prints the help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.given: set[str] = set()  # dests given in the parse under way
        self.repeated: list[argparse.Action] = []  # options given again in it
        self.register("action", "store", _StoreOnce)
        self.register("action", None, _StoreOnce)  # add_argument without action= looks up None

    def parse_known_args(self, args=None, namespace=None):
        self.given, self.repeated = set(), []
        out = super().parse_known_args(args, namespace)
        if self.repeated:
            self.error(f"{'/'.join(self.repeated[0].option_strings)} was given twice; give it once")
        return out
