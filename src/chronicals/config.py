"""The training config: the typed dataclasses of ``config_schema`` filled from YAML and ``key=value`` overrides.

This module reads a YAML file (errors as ``FILE:LINE: message``), parses and types the overrides, refuses
unknown keys with a suggestion and renders ``chronicals train --help``; the sections, their field docs and
their checks are ``config_schema``'s. Every schema name is re-exported here, so callers import from
``chronicals.config`` alone.

    cfg = load_config("configs/smollm2-135m/lora.yaml", ["optim.lr=1e-4", "lora.rank=16"])
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import sys
import types
import typing
from pathlib import Path

import yaml

from ._numbers import is_int
from .config_schema import (
    ATTENTION_KERNELS,
    BOOL_WORDS,
    DEMO,
    DEMO_SYSTEM_PROMPT,
    KNOWN_ELSEWHERE,
    LORA_PROJECTIONS,
    LORA_VALUE_RULES,
    MAX_ROW_TOKENS,
    SECTION_TYPES,
    _STORED,
    ConfigError,
    DataSection,
    EvalSection,
    LoggingSection,
    LoraSection,
    ModelSection,
    OptimSection,
    ScheduleSection,
    TrainConfig,
    TrainSection,
    _unknown,
    all_keys,
    lora_names_problem,
    shown,
)

__all__ = [
    # the schema (config_schema)
    "ATTENTION_KERNELS", "BOOL_WORDS", "DEMO", "DEMO_SYSTEM_PROMPT", "LORA_PROJECTIONS", "LORA_VALUE_RULES",
    "MAX_ROW_TOKENS", "SECTION_TYPES", "ConfigError", "DataSection", "EvalSection", "LoggingSection", "LoraSection",
    "ModelSection", "OptimSection", "ScheduleSection", "TrainConfig", "TrainSection", "lora_names_problem",
    # filling it (here)
    "all_keys", "config_help", "from_dict", "load_config",
]

log = logging.getLogger("chronicals.config")


def _field_type(cls, name: str):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(key: str, value, typ):
    """Turn a YAML / command-line value into the field's type, or fail saying what was expected."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or value == "null":
            return None
        typ = args[0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # YAML reads 1 / 0 as integers; BOOL_WORDS has them
            return bool(value)
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return BOOL_WORDS[value.lower()]
        raise ConfigError(f"config {key}={shown(value)} is invalid: expected true or false", key)
    if typ is int:
        if not (is_int(value) or isinstance(value, str) and _is_int_text(value)):
            raise ConfigError(f"config {key}={shown(value)} is invalid: expected an integer", key)
        return int(value)
    if typ is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # YAML reads 3e-4 (no dot) as a string; float() takes it
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer of 400 digits
            raise ConfigError(f"config {key}={shown(value)} is invalid: expected a number", key) from None
    if typ is list or origin is list:
        example = {"model.recompute": "[norm, swiglu]", "lora.modules_to_save": "[embed_tokens, lm_head]"}.get(
            key, "[q_proj, v_proj]")
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("[") != text.endswith("]"):  # "[q_proj" had read as [q_proj]
                raise ConfigError(f"config {key}={shown(value)} is invalid: an unclosed bracket; expected a list "
                                  f"such as {example} ([] for none)", key)
            value = [v.strip() for v in text.strip("[]").split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config {key}={shown(value)} is invalid: expected a list such as {example} "
                              "([] for none)", key)
        return list(value)
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config {key}={shown(value)} is invalid: expected a string", key)
        return "" if value is None else str(value)
    return value


def _is_int_text(s: str) -> bool:
    try:
        int(s)
        return True
    except ValueError:
        return False


def _is_str_key(key: str) -> bool:
    section, _, name = key.partition(".")
    cls = SECTION_TYPES.get(section)
    return cls is not None and name in {f.name for f in dataclasses.fields(cls)} and _field_type(cls, name) is str


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader without YAML 1.1's timestamps: no key takes a date, and ``train.out_dir=2024-02-30`` failed as
    'day is out of range for month' naming no key, where 2024-02-28 was read as a date object. Such text stays a
    string: a string key takes it as written, any other key's type check names itself."""


_ConfigLoader.yaml_implicit_resolvers = {  # a copy per first character: SafeLoader's own stay as they are
    ch: [(tag, rx) for tag, rx in rs if tag not in ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:int")]
    for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
# ints without YAML 1.1's octal and base-60 forms (save_every: 010 was 8, max_steps: 1:30 was 90): such text stays
# a string, which an int key's type check names; binary and hex stay, as YAML 1.2 has them
_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))

# what else pyyaml raises on text it parsed: a tag its constructor refuses (!!float abc: ValueError, !!binary: a
# binascii error, a ValueError too), and nesting deeper than the recursion limit (RecursionError, was exit 4)
_YAML_VALUE_ERRORS = (ValueError, RecursionError)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_ConfigLoader)


def _override_value(key: str, text: str):
    """A command-line value: a string key takes the text as written (YAML reads yes as True, 0x10 as 16 and cuts
    'You are #1' at the '#', and a text that starts with '#' whole), less its quotes when quoted, '' for null
    written as null (``~`` is the home directory there, as a path); any other key the text's YAML value, or the
    text itself when it is no YAML (``optim.lr=[1``), which the key's type check then refuses."""
    try:
        value = _load_yaml(text) if text else ""
    except (yaml.YAMLError, *_YAML_VALUE_ERRORS):
        return text
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    # null only when written as null: '~' is the home directory on a command line (train.out_dir=~ was ''), and
    # '# Role: ...' is YAML's comment, whose None made data.system_prompt='' (the template's default prompt)
    if _is_str_key(key) and not quoted and text.strip() not in ("", "null", "Null", "NULL"):
        return text
    return value


def from_dict(d: dict | None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """Build a TrainConfig from nested ``{section: {field: value}}`` plus dotted overrides.

    Unknown sections/keys fail with a "did you mean" suggestion; values are typed and checked.
    """
    flat: dict[str, object] = {}
    for section, body in (d or {}).items():
        if section not in SECTION_TYPES:
            raise _unknown(section, list(SECTION_TYPES))
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"config section {section!r} must be a mapping of keys to values, got {shown(body)}",
                              section)
        for k, v in body.items():
            flat[f"{section}.{k}"] = v
    if isinstance(overrides, dict):
        flat.update(overrides)
    else:
        given: dict[str, str] = {}  # key -> its override as written: a key given twice is refused, as in a YAML file
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value (e.g. optim.lr=3e-4)", item)
            k, v = item.split("=", 1)
            k = k.strip()
            if k in given:
                raise ConfigError(f"{k} given twice ({given[k]} and {item}); give it once", k)
            given[k] = item
            flat[k] = _override_value(k, v.strip())
    known = set(all_keys())
    values: dict[str, dict] = {s: {} for s in SECTION_TYPES}
    # every bad key and value at once, not one per run (a user walk fixed three values in three runs); a section
    # with a value of the wrong type is not built: its checks would meet the default standing in for that value
    errors: list[ConfigError] = []
    untyped: set[str] = set()
    for key, v in flat.items():
        if key not in known:
            errors.append(_unknown(key, sorted(known)))
            continue
        section, name = key.split(".", 1)
        try:
            values[section][name] = _coerce(key, v, _field_type(SECTION_TYPES[section], name))
        except ConfigError as e:
            errors.append(e)
            untyped.add(section)
    sections = {}
    for s, cls in SECTION_TYPES.items():
        if s in untyped:
            continue
        try:
            sections[s] = cls(**values[s])  # its __post_init__ checks (the first bad value of the section)
        except ConfigError as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)
    return TrainConfig(**sections)


class ConfigErrors(ConfigError):
    """Several bad keys or values of one config, each a ConfigError (``errors``): one message line each."""

    def __init__(self, errors: list[ConfigError]):
        super().__init__("\n".join(map(str, errors)), errors[0].key)
        self.errors = errors


_KEY_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def _key_name(node: yaml.Node) -> str:
    """A mapping key as ``from_dict`` names it: str of the value YAML builds (``5`` -> '5', ``~`` -> 'None')."""
    if isinstance(node, yaml.ScalarNode) and node.tag != "tag:yaml.org,2002:merge":  # '<<' has no constructor
        return str(_KEY_CONSTRUCTOR.construct_object(node))
    return str(node.value)


def _key_lines(text: str, source, plain: dict[str, str] | None = None) -> dict[str, int]:
    """1-based line of every section and ``section.key`` in a YAML mapping of mappings (for error messages);
    ``plain`` gets the text of each ``section.key`` written as a plain (unquoted) scalar.

    A section or key written twice fails here, naming both lines: ``yaml.safe_load`` keeps the last one
    silently, so a typo fixed further down (lr: abc ... lr: 1e-3) would hide which one counts.
    """
    lines: dict[str, int] = {}

    def note(name: str, node: yaml.Node):
        line = node.start_mark.line + 1
        if name in lines:
            raise ConfigError(f"{source}:{line}: duplicate key {name} (also at line {lines[name]}); "
                              "keep one of them", name)
        lines[name] = line

    root = yaml.compose(text, Loader=_ConfigLoader)
    if not isinstance(root, yaml.MappingNode):
        return lines
    for sec, body in root.value:
        note(_key_name(sec), sec)
        if isinstance(body, yaml.MappingNode):
            for k, v in body.value:
                note(f"{_key_name(sec)}.{_key_name(k)}", k)
                if plain is not None and isinstance(v, yaml.ScalarNode) and v.style is None:
                    plain[f"{_key_name(sec)}.{_key_name(k)}"] = v.value
    return lines


def _yaml_error(source, e: yaml.YAMLError, text: str = "") -> str:
    """pyyaml's error as ``FILE:LINE:COL: invalid YAML: problem (context at LINE:COL)`` (1-based, like editors)."""
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow: pyyaml gives its offset only
        pos = e.position
        line, col = text.count("\n", 0, pos) + 1, pos - text.rfind("\n", 0, pos)
        code = e.character if isinstance(e.character, int) else ord(e.character)
        return (f"{source}:{line}:{col}: invalid YAML: character U+{code:04X} is not allowed "
                "(remove it or write it as an escape inside double quotes)")
    mark = getattr(e, "problem_mark", None)
    if mark is None or not getattr(e, "problem", None):
        return f"{source}: invalid YAML ({e})"
    msg = f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {e.problem}"
    ctx, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if ctx and cmark is not None and (cmark.line, cmark.column) != (mark.line, mark.column):
        where = f"{cmark.line + 1}:{cmark.column + 1}"  # e.g. where an unclosed [ began
        if e.problem.startswith("but "):  # "expected a single document ..., but found another document"
            msg = f"{source}:{mark.line + 1}:{mark.column + 1}: invalid YAML: {ctx} (from {where}), {e.problem}"
        else:
            msg += f" ({ctx} at {where})"
    if "'\\t'" in e.problem:
        msg += " (YAML must indent with spaces, not tabs)"
    return msg


def _override_keys(overrides) -> set[str]:
    """The keys the overrides set (an item without '=' stands for itself: its error is the override's)."""
    if isinstance(overrides, dict):
        return set(overrides)
    return {item.split("=", 1)[0].strip() if "=" in item else item for item in overrides or []}


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> TrainConfig:
    """YAML file (optional) + ``key=value`` overrides -> a checked TrainConfig.

    A bad key or value from the file fails as ``FILE:LINE: message`` (the line of that key, or of its section);
    one set by an override as ``command line: message`` (``overrides: message`` for a dict).
    """
    d, lines = {}, {}
    if path is not None:
        p = Path(path)
        if p.is_dir():  # FileNotFoundError too: the CLI reports both as a config error (exit 2)
            raise FileNotFoundError(f"config {p} is a directory, not a YAML file (give a file such as "
                                    "configs/smollm2-135m/lora.yaml)")
        if not p.exists():  # a pipe (bash's <(...)) is read: it had been "not found"
            raise FileNotFoundError(f"config file {p} not found (give a YAML file such as configs/smollm2-135m/lora.yaml)")
        try:
            raw = p.read_bytes()
        except OSError as e:  # permissions, a FIFO, an I/O error: a config error (exit 2), not an internal one
            raise ValueError(f"config file {p} cannot be read ({e.strerror or e}); check its permissions") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # 1-based line and byte column, like a YAML error
            line, col = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
            raise ValueError(f"{p}:{line}:{col}: not UTF-8 (byte 0x{raw[e.start]:02x}); "
                             "save the file as UTF-8") from None
        try:
            d = _load_yaml(text) or {}
            lines = _key_lines(text, p, plain := {})
        except yaml.YAMLError as e:
            raise ValueError(_yaml_error(p, e, text)) from None
        except ConfigError as e:  # a duplicate key: the message already names the file and both lines
            raise ValueError(str(e)) from None
        except RecursionError:
            raise ValueError(f"{p}: invalid YAML: nested too deeply (more than Python's recursion limit of "
                             f"{sys.getrecursionlimit()} levels); a config is sections of keys") from None
        except ValueError as e:  # a tag pyyaml cannot construct: !!float abc
            raise ValueError(f"{p}: invalid YAML: a value cannot be read ({e}); check its explicit tag "
                             "(!!float, !!int, ...), or remove the tag") from None
        if not isinstance(d, dict):
            raise ValueError(f"{p}: expected a mapping of sections (model, data, lora, ...), got {type(d).__name__}")
        if not d:  # an empty or comment-only file is valid YAML, but likely not what was meant
            log.warning("config %s sets nothing: every key takes its default (the embedded demo's model and data)", p)
        for section in (k for k, v in d.items() if v is None):  # 'data:' with its keys not indented under it
            where = f"{p}:{lines[section]}" if lines.get(section) else str(p)
            log.warning("config %s: section %s: has no keys under it, so every %s.* key takes its default%s; indent "
                        "its keys under it (or remove the line)", where, section, section,
                        " (data.path=demo: the embedded demo data)" if section == "data" else "")
        for key, written in plain.items():  # a string key as written: YAML reads yes as True, 0x10 as 16
            section, name = key.split(".", 1)
            if _is_str_key(key) and not isinstance(d[section][name], str) and d[section][name] is not None:
                d[section][name] = written
        if "train.out_dir" not in _override_keys(overrides) and not _STORED.get():  # chat reads it for its prompt
            _continue_in_place(p, d)
    try:
        return from_dict(d, overrides)
    except ValueError as e:
        errs = sorted(getattr(e, "errors", [e]), key=lambda err: _line_of(err, lines, overrides))  # as the file reads
        # a ConfigError, as from_dict's own: a script catching ConfigError caught a dict's bad value, not a file's
        raise ConfigError("\n".join(_placed(err, path, lines, overrides) for err in errs),
                          getattr(errs[0], "key", None)) from None


RUN_CONFIG = "config.yaml"  # the config a run writes into its train.out_dir (train.run_dir.config_yaml)


def run_dir_of(path: Path) -> Path | None:
    """The run directory whose own config.yaml ``path`` is (it sits beside the run's metrics.jsonl or checkpoints/,
    which a run writes with it), else None: a recipe of that name elsewhere is not a run's."""
    folder = path.parent
    if path.name != RUN_CONFIG or not ((folder / "metrics.jsonl").is_file() or (folder / "checkpoints").is_dir()):
        return None
    return folder


def _continue_in_place(path: Path, d: dict) -> None:
    """A run's own config.yaml continues the run in the directory it sits in: its train.out_dir is as typed when
    the run started, read from the working directory, so from another directory (or in a copy of the run:
    cp -r runs/a runs/b) it named another folder, which started from scratch there (or resumed and wrote into
    runs/a). An override of train.out_dir is the caller's choice and is not reached here."""
    run = run_dir_of(path)
    train = d.get("train") if isinstance(d.get("train"), dict) else None
    if run is None or (train is None and "train" in d):  # a bad train section: from_dict says so
        return
    stored = (train or {}).get("out_dir")
    if isinstance(stored, str) and stored and _same_dir(stored, run):
        return
    run = run if str(run) != "." else Path.cwd()  # `chronicals train config.yaml` inside the run: named, not "."
    d.setdefault("train", {})["out_dir"] = str(run)
    elsewhere = (f"it records train.out_dir={stored}, which from {Path.cwd()} is another directory"
                 if isinstance(stored, str) and stored else "it records no train.out_dir")
    log.info("config %s is the config.yaml of the run in %s: continuing that run there (%s); set train.out_dir "
             "to write elsewhere", path, run, elsewhere)


def _same_dir(a: str, b: Path) -> bool:
    """Whether the directory path ``a`` (~ expanded, relative to the working directory) is ``b``."""
    try:
        return Path(a).expanduser().resolve() == b.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return False


def _file_line(e: ValueError, lines: dict, overrides) -> int | None:
    """The file line of an error's key (or of its section: a '<<' merge), None for a value from the overrides."""
    key = getattr(e, "key", None)
    if key is None or key in _override_keys(overrides):
        return None
    return lines.get(key) or lines.get(key.split(".", 1)[0])


def _line_of(e: ValueError, lines: dict, overrides) -> float:
    """Sort key: the file's lines in order, then the command line's values."""
    return _file_line(e, lines, overrides) or math.inf


def _placed(e: ValueError, path, lines: dict, overrides) -> str:
    """One error's message after where its value was set: ``FILE:LINE``, the command line (or ``overrides`` for a
    dict), or the file alone."""
    key = getattr(e, "key", None)
    if key is not None and key in _override_keys(overrides):  # the value came from there, not the file
        return f"{'overrides' if isinstance(overrides, dict) else 'command line'}: {e}"
    if not path:
        return str(e)
    line = _file_line(e, lines, overrides)
    return f"{path}:{line}: {e}" if line else f"{path}: {e}"


def config_help() -> str:
    """Every key with its type, default and one-line doc (what ``chronicals train --help`` prints)."""
    lines = []
    for section, cls in SECTION_TYPES.items():
        lines.append(f"{section}:")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            t = getattr(hints[f.name], "__name__", str(hints[f.name]))
            lines.append(f"  {section}.{f.name} ({t}, default {default!r})\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)
