"""The package's imports run one way (DEVELOPERS.md: ops -> models -> lora -> train -> evaluate/bench -> cli; data
and config depend on nothing of ours but the leaves). Read from the source, lazy imports inside functions included:
a helper imported from a higher layer "just this once" ties the layers together for good, and no other test
notices."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "chronicals"

# leaf modules: import nothing of ours, and every unit may import them
LEAVES = {"_words", "_jsonio", "_numbers", "_cli_args", "cuda_alloc"}
# unit -> the units of ours it may import besides itself and the leaves ("root": chronicals/__init__.py, which
# re-exports models' load_model / save_model)
LOWER = {leaf: set() for leaf in LEAVES} | {
    "ops": set(),
    "data": set(),
    "config_schema": set(),
    "config": {"config_schema"},
    "models": {"ops"},
    "root": {"models"},
    "lora": {"ops", "models", "config"},
    "train": {"ops", "models", "lora", "data", "config", "config_schema", "root"},
}
LOWER["evaluate"] = LOWER["bench"] = LOWER["train"] | {"train"}
BELOW_CLI = set(LOWER)
LOWER |= {"cli_models": BELOW_CLI, "cli_chat": BELOW_CLI | {"cli_models"}, "cli_eval": BELOW_CLI | {"cli_models"},
          "cli": BELOW_CLI | {"cli_models", "cli_chat", "cli_eval"}, "__main__": {"cli"}}


def unit_of(path: Path) -> str:
    """src/chronicals/ops/rope.py -> "ops"; src/chronicals/config.py -> "config"; __init__.py -> "root"."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return "root" if parts == ("__init__",) else parts[0]


def _unit(dotted: list[str]) -> str:
    """["train", "loop"] -> "train"; ["load_model"] (a name chronicals/__init__.py defines) -> "root"."""
    head = dotted[0] if dotted else ""
    return head if head and ((SRC / head).is_dir() or (SRC / f"{head}.py").exists()) else "root"


def imported_units(path: Path) -> dict[str, int]:
    """The units of ours ``path`` imports (anywhere in the file), each with the line of its first import."""
    pkg = list(path.relative_to(SRC).parts[:-1])  # the file's package below chronicals
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)]
            targets = [base + node.module.split(".")] if node.module else [base + [a.name] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "chronicals":
            rest = node.module.split(".")[1:]
            targets = [rest] if rest else [[a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".")[1:] for a in node.names if a.name.split(".")[0] == "chronicals"]
        else:
            continue
        for t in targets:
            found.setdefault(_unit(t), node.lineno)
    return found


FILES = sorted(SRC.rglob("*.py"))


def test_every_unit_of_the_package_has_a_place_in_the_layers():
    units = {unit_of(f) for f in FILES}
    assert units - set(LOWER) == set(), "a new module or package: give it a place in LOWER"
    assert {"ops", "models", "lora", "data", "train", "config", "cli"} <= units  # the scan finds the package


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_go_down_the_layers_only(path):
    unit = unit_of(path)
    allowed = {unit} if unit in LEAVES else {unit} | LEAVES | LOWER[unit]
    wrong = {u: line for u, line in imported_units(path).items() if u not in allowed}
    assert not wrong, (f"{path.relative_to(SRC.parents[1])} imports "
                       + ", ".join(f"{u} (line {n})" for u, n in wrong.items())
                       + f": not below {unit}; move the shared piece down (a leaf module, like _words) "
                       "or the caller up")


def test_the_ops_never_import_transformers():
    """ops/ is torch and triton (and, lazily, NVIDIA's cudnn frontend)."""
    for path in (SRC / "ops").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "transformers"], (path, node.lineno)


def test_the_scan_finds_lazy_imports_from_above(tmp_path, monkeypatch):
    """Function-level imports count, relative or absolute, and a name from chronicals/__init__.py is the root's."""
    src = tmp_path / "chronicals"
    (src / "train").mkdir(parents=True)
    (src / "ops").mkdir()
    (src / "_words.py").write_text("")
    probe = src / "ops" / "probe.py"
    probe.write_text("import torch\nfrom .._words import counted\n\n\ndef f():\n    from ..train.loop import train\n"
                     "    from .. import load_model\n    import chronicals.train.step\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", src)
    assert imported_units(probe) == {"_words": 2, "train": 6, "root": 7}
    with pytest.raises(AssertionError, match=r"imports train \(line 6\), root \(line 7\): not below ops"):
        test_imports_go_down_the_layers_only(probe)
