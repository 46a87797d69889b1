"""The command line of ``mfsdp train`` and ``mfsdp plan``: ``--config FILE.yaml`` and
``--SECTION.KEY VALUE`` flags into a ``RunConfig``, and the ``--help`` text. ``mfsdp prepare-data``
and ``mfsdp export`` parse their flags and render their help with the same functions (``parse_command``).

Values come from three layers, later ones winning: the sections' defaults, an optional ``--config
FILE.yaml`` with one mapping per section, and flags. A key that no section declares is an error that
names the nearest known one, rather than a silent no-op: a misspelt flag that is ignored costs a
whole training run.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path

from mfsdp.train.run.config import FROM_RECIPE, RunConfig
from mfsdp.train.command.errors import ConfigError

# The sections of a config (ModelSection...), by the name its flags and YAML mappings use.
SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(RunConfig) if callable(f.default_factory)}

# Flags of the `mfsdp train` launcher (mfsdp/train/command/launcher.py) and the LaunchOptions field each
# sets, named here so that a worker started by torchrun can say where they belong.
LAUNCHER_FLAGS = {"--nproc-per-node": ("nproc_per_node", int), "--nnodes": ("nnodes", int),
                  "--node-rank": ("node_rank", int), "--rdzv-endpoint": ("rdzv_endpoint", str),
                  "--rdzv-id": ("rdzv_id", str), "--max-restarts": ("max_restarts", int),
                  "--stop-timeout": ("stop_timeout_s", float)}
TRAIN_FLAGS = {**{flag: f"the launcher flag {flag}" for flag in LAUNCHER_FLAGS},
               **{flag: flag for flag in ("--config", "--resume", "--help")}}
"""The flags of `mfsdp train` besides --SECTION.KEY, and how a did-you-mean names each."""

USAGE = """usage: mfsdp train [LAUNCHER FLAGS] [--config FILE.yaml] [--resume [auto]] [--SECTION.KEY VALUE ...]

Trains a Llama-style model with mfsdp. Several processes, on one node or several:
  mfsdp train --nproc-per-node 8 --train.steps 100
  mfsdp train --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 ...  (on each node)
(`torchrun --nproc-per-node 8 -m mfsdp.train ...` works too.)
Launcher flags:
  --nproc-per-node N      worker processes on this node (one per GPU)
  --nnodes N              nodes in the job (default 1); start one `mfsdp train` per node
  --rdzv-endpoint H:P     rendezvous host and port, the same on every node (needed with --nnodes)
  --node-rank R           this node's index; node 0 hosts the rendezvous (default: by hostname)
  --rdzv-id ID            job id shared by the nodes (default: $SLURM_JOB_ID or "mfsdp")
  --max-restarts N        restart the workers up to N times after a failure (default 0)
  --stop-timeout S        seconds the workers get to save and exit after Ctrl-C, SIGTERM or a
                          lost rank before they are killed (default 50)
"""


def usage(head: str = USAGE, sections: dict[str, type] = SECTIONS, aliases: dict[str, str] = {}) -> str:
    """The ``--help`` text: ``head``, then every key of ``sections`` with its default and its whole
    docstring, wrapped, and the old spellings in ``aliases`` that still set it."""
    lines = [head + "Sections and keys (defaults in parentheses):\n"]
    for section, cls in sections.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            default = "the recipe's" if section == "train" and f.name in FROM_RECIPE else repr(f.default)
            old = [alias + " (no value)" * ("=" in target) for alias, target in aliases.items()
                   if target.partition("=")[0] == key]
            text = docs.get(f.name, "") + (f" Old spelling, kept for one release: {' or '.join(old)}." if old else "")
            flag = f"  {f'--{key} ({default})':<44} "
            lines.append(textwrap.fill(text, 110, initial_indent=flag, subsequent_indent=" " * 47,
                                       break_on_hyphens=False, break_long_words=False) or flag.rstrip())
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string that follows the field in the class body, its base classes'
    too), on one line; empty where the source is not available."""
    docs = {}
    for klass in cls.__mro__[::-1]:
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                docs[node.target.id] = " ".join(str(after.value.value).replace("``", "").split())
    return docs


def flag_value(argv: list[str], i: int) -> tuple[str, str, int]:
    """The flag at ``argv[i]``, its value (``--flag value`` or ``--flag=value``) and the index after
    them; the launcher's flags and the config's are spelt alike. A flag followed by another flag
    has no value: an error naming it, not the next flag taken as its value."""
    flag, eq, value = argv[i].partition("=")
    if eq:
        return flag, value, i + 1
    if i + 1 >= len(argv):
        raise ConfigError(f"{flag} needs a value")
    if argv[i + 1].startswith("--"):
        raise ConfigError(f"{flag} needs a value, but the next argument is the flag {argv[i + 1]}; "
                          f"write {flag} VALUE")
    return flag, argv[i + 1], i + 2


def parse_config(argv: list[str]) -> RunConfig:
    """Parse ``argv`` (without the program name) into a validated RunConfig, as given: what the values
    name (a --model.hf directory) is looked up by ``mfsdp.train.run.resolve``, not here."""
    values: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    resume, flags = False, []  # flags: (section, name, text), applied after every --config file
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--resume", "--resume=auto"):
            auto = arg.endswith("=auto") or argv[i + 1:i + 2] == ["auto"]
            resume, i = ("auto" if auto else True), i + (2 if argv[i + 1:i + 2] == ["auto"] else 1)
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --train.steps 100")
        if arg.partition("=")[0] in LAUNCHER_FLAGS:
            raise ConfigError(f"{arg.partition('=')[0]} is a flag of the `mfsdp train` launcher; "
                              "under torchrun give the launcher's flags to torchrun, before -m")
        if arg.partition("=")[0] == "--config":
            _, path, i = flag_value(argv, i)
            _merge_yaml(values, Path(path))
        else:
            section, name, value, i = next_flag(argv, i)
            flags.append((section, name, value))
    for section, name, value in flags:
        values[section][name] = _parse_text(section, name, value)
    given = tuple(f"--dpo.{name}" for name in values["dpo"])  # refused on data without pairs, even at defaults
    return RunConfig(resume=resume, dpo_given=given, **_sections(values))


def parse_command(argv: list[str], sections: dict[str, type], aliases: dict[str, str],
                  positional: tuple[str, ...]) -> tuple[list[str], dict[str, object]]:
    """The ``positional`` arguments and the ``sections`` (dataclasses, by flag prefix) of a command line,
    read as `mfsdp train` reads its flags; ``aliases``: old spellings and the key each sets (``--max-len``:
    ``data.max_len``), with its value where the old one was a switch (``data.train_on_prompt=true``)."""
    known = {**{old: "--" + key.partition("=")[0] for old, key in aliases.items()}, "--help": "--help"}
    args, values, i = [], {section: {} for section in sections}, 0
    while i < len(argv):
        if argv[i].startswith("--"):
            section, name, text, i = next_flag(argv, i, sections, aliases, known)
            values[section][name] = _parse_text(section, name, text, sections)
        else:
            args.append(argv[i])
            i += 1
    if len(args) != len(positional):
        raise ConfigError(f"expects {' '.join(positional)}, got {' '.join(map(repr, args)) or 'none'}")
    return args, _sections(values, sections)


def next_flag(argv: list[str], i: int, sections: dict[str, type] = SECTIONS, aliases: dict[str, str] = {},
              known: dict[str, str] = TRAIN_FLAGS) -> tuple[str, str, str, int]:
    """The section, name and text of the flag at ``argv[i]`` (an alias read as the key it sets), and the
    index after it; ``known``: the other flags a did-you-mean may name, and how."""
    flag = argv[i].partition("=")[0]
    key, _, switch = aliases.get(flag, flag[2:]).partition("=")
    section, name = _split_key(key, sections, known)
    if switch and "=" not in argv[i]:
        return section, name, switch, i + 1
    return (section, name, *flag_value(argv, i)[1:])


def _sections(values: dict[str, dict[str, object]], sections: dict[str, type] = SECTIONS) -> dict[str, object]:
    """Each section's dataclass of its ``values``; its ValueError or TypeError as a ConfigError."""
    try:
        return {section: cls(**values[section]) for section, cls in sections.items()}
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _split_key(key: str, sections: dict[str, type] = SECTIONS, known: dict[str, str] = TRAIN_FLAGS) -> tuple[str, str]:
    """The section and name of the flag ``--KEY``; ConfigError with the nearest known flag."""
    section, dot, name = key.partition(".")
    if not dot or section not in sections:
        near = _nearest(key, sections, known)
        raise ConfigError(f"unknown flag --{key}; " + (
            f"did you mean {known.get(f'--{near}', f'--{near}')}?" if near else
            f"flags look like --SECTION.KEY with SECTION one of {', '.join(sections)} (see --help)"))
    _field_type(section, name, "--", sections)
    return section, name


def _field_type(section: str, name: str, spelling: str = "", sections: dict[str, type] = SECTIONS) -> object:
    """The type of ``section.name``; ConfigError naming the nearest key (as ``spelling`` + key:
    "--" for a flag) and the section's keys."""
    hints = typing.get_type_hints(sections[section])
    if name not in hints:
        near = _nearest(f"{section}.{name}", sections)
        mean = f"did you mean {spelling}{near}? " if near else ""
        raise ConfigError(f"unknown config key {section}.{name}; {mean}known keys of {section}: {', '.join(hints)}")
    return hints[name]


def _nearest(key: str, sections: dict[str, type] = SECTIONS, known: dict[str, str] = {}) -> str | None:
    """The known ``section.name`` (or flag of ``known``, without its dashes) nearest to ``key``: the
    same name in another section, else the closest spelling (``difflib``)."""
    section, _, name = key.partition(".")
    elsewhere = [f"{s}.{name}" for s, cls in sections.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if elsewhere:
        return elsewhere[0]
    keys = [f"{s}.{f.name}" for s, cls in sections.items() for f in dataclasses.fields(cls)]
    own = [k for k in keys if k.startswith(section + ".")]
    flags = [f.removeprefix("--") for f in known]
    near = difflib.get_close_matches(key, own, n=1) or difflib.get_close_matches(key, keys + flags, n=1, cutoff=0.75)
    return near[0] if near else None


def _merge_yaml(values: dict[str, dict[str, object]], path: Path) -> None:
    try:
        import yaml  # part of the `train` extra; only needed for --config
    except ImportError:
        raise ConfigError("--config needs PyYAML: pip install pyyaml") from None
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a mapping of sections ({', '.join(SECTIONS)})")
    for section, entries in loaded.items():
        if section not in SECTIONS:
            near = difflib.get_close_matches(str(section), SECTIONS, n=1)
            raise ConfigError(f"unknown config section {section!r} in {path}; " + (
                f"did you mean {near[0]}? " if near else "") + f"known sections: {', '.join(SECTIONS)}")
        if not isinstance(entries, dict):
            raise ConfigError(f"section {section!r} in {path} must be a mapping of keys")
        for name, value in entries.items():
            values[section][name] = _check_type(section, name, value)


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A number as YAML 1.1 may leave it a string: 1e-3 (no dot), 3E4."""


def _number(value: object, kind: type) -> int | float | None:
    """``value`` (YAML's, or a flag's text) as the number ``kind`` where it is one, else None: a
    float field takes 1e-3 even as a string; an int field takes 1000, 1e3 or 1000.0, never 1.5."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        value = int(value) if value.strip().lstrip("+-").isdigit() else float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if kind is float:
        return float(value)
    return value if isinstance(value, int) else int(value) if value.is_integer() else None


def _parse_text(section: str, name: str, text: str, sections: dict[str, type] = SECTIONS) -> object:
    """Convert a command-line string to the field's type."""
    options = _type_options(section, name, sections)
    if type(None) in options and text.lower() in ("none", "null"):
        return None
    base = next(t for t in options if t is not type(None))
    try:
        if base is bool:
            if text.lower() not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes", "on")
        return base(text)
    except ValueError:
        if base in (int, float) and (number := _number(text, base)) is not None:
            return number
        raise ConfigError(f"--{section}.{name} expects {base.__name__}, got {text!r}") from None


def _check_type(section: str, name: str, value: object) -> object:
    """Check a YAML value against the field's type (numbers as ``_number`` takes them)."""
    options = _type_options(section, name)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option in (int, float):
            if (number := _number(value, option)) is not None:
                return number
        elif option is not type(None) and isinstance(value, option):
            return value
    names = "/".join(getattr(t, "__name__", str(t)) for t in options)
    raise ConfigError(f"{section}.{name} expects {names}, got {value!r}")


def _type_options(section: str, name: str, sections: dict[str, type] = SECTIONS) -> tuple:
    """The types a field accepts: the members of an Optional/Union, else the type alone."""
    kind = _field_type(section, name, sections=sections)
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return typing.get_args(kind)
    return (kind,)
