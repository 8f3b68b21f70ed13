"""The reference pages against the code: docs/configuration.md against ``ckptd/config.py`` and the ``ckptd serve``
parser, docs/cli.md against the whole parser of :mod:`ckptd.cli`.

configuration.md: every TOML key (``SERVE_KEYS``, the ``[remote]`` table's ``RemoteConfig`` fields and tier keys) has
one row in the daemon's table, naming the flags whose destination it is; its default is written as a TOML literal
equal to what ``daemon_config`` gives (in words where the code's default is ``None`` or required); a key's row names
exactly the variables that set it (each variable read in ``ckptd/`` is set in turn and ``daemon_config`` compared);
every ``CKPTD_*`` variable read in ``ckptd/`` has a row in the table of the side that reads it (the daemon's, the
trainer's, or both), every one named there has a row, and no row names a variable nothing reads. cli.md: a section
per subcommand naming each of its options and positionals, with a synopsis that shows every choice and no flag the
command lacks. The checkers return their problems; the ``*_catches_*`` tests drop one row or one flag at a time and
require a problem, so no check passes vacuously.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import grp
import os
import re
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from ckptd import cli, config
from ckptd.config import DaemonConfig, daemon_config
from ckptd.s3config import DirConfig, RemoteConfig

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "ckptd"
CONFIGURATION = REPO / "docs" / "configuration.md"
CLI = REPO / "docs" / "cli.md"

VAR_RE = re.compile(r"CKPTD_[A-Z0-9_]+")
FLAG_RE = re.compile(r"--[a-z][a-z0-9-]*")
DAEMON_HEADER = ["`ckptd serve` flag", "TOML key", "environment variable", "default", "meaning"]
CLIENT_HEADER = ["environment variable", "`Client` argument", "default", "meaning"]
NO_LITERAL = object()  # a default cell written in prose
ENV_READERS = {"get", "getenv", "env_int", "env_float", "_env"}  # os.environ.get, os.getenv, config's readers
# values that differ from the default, to see which key a variable sets (numbers and booleans are derived)
PROBES = {
    "root": "/ckptd-docs-probe",
    "endpoint": "ipc:///ckptd-docs-probe.sock",
    "lagging": "memory",
    "log_level": "DEBUG",
    "shm_budget": "1G",
    "peer_listen": "tcp://127.0.0.1:7100",
    "peer_key": "/ckptd-docs-probe.key",
    "peers": "tcp://127.0.0.1:7101",
    "replica_budget": "1G",
}
BASE_ROOT = "/ckptd-docs-root"


def _a_group() -> str:
    try:
        return grp.getgrgid(os.getegid()).gr_name
    except KeyError:  # a gid without a name (a container's): any group that has one
        return grp.getgrall()[0].gr_name


# ---------------------------------------------------------------------------- reading the page and the code


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table: its header cells and its rows' cells (``\\|`` unescaped)."""
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
        elif block:
            tables.append((block[0], block[2:]))
            block = []
    return tables


def _table(text: str, header: list[str]) -> list[dict[str, str]]:
    found = [rows for head, rows in _tables(text) if head == header]
    assert len(found) == 1, f"{len(found)} tables headed {' | '.join(header)} (want one)"
    return [dict(zip(header, row, strict=True)) for row in found[0]]


def _toml_key(cell: str) -> tuple[str, str] | None:
    """``(section, key)`` of a TOML key cell (`` `keep` in `[remote]` `` is ``("remote", "keep")``), ``None`` for none."""
    spans = re.findall(r"`([^`]+)`", cell)
    sections = [s[1:-1] for s in spans if s.startswith("[")]
    keys = [s for s in spans if not s.startswith("[")]
    assert len(sections) <= 1 and len(keys) <= 1, f"a TOML key cell names one key, in at most one section: {cell!r}"
    return (sections[0] if sections else "", keys[0]) if keys else None


def _literal(cell: str) -> Any:
    """The value of the TOML literal a default cell starts with, or ``NO_LITERAL``."""
    m = re.match(r"`([^`]+)`", cell)
    if not m:
        return NO_LITERAL
    try:
        return tomllib.loads(f"v = {m.group(1)}")["v"]
    except tomllib.TOMLDecodeError:
        return NO_LITERAL


def _same(written: Any, actual: Any) -> bool:
    if isinstance(written, str) and isinstance(actual, int) and not isinstance(actual, bool):
        written = config.parse_size(written)  # sizes are written as in the file: "64M"
    if isinstance(actual, tuple):  # a TOML list (peers) is kept as a tuple
        actual = list(actual)
    return isinstance(written, bool) == isinstance(actual, bool) and written == actual


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Only ``values`` among the ``CKPTD_*`` variables; the runtime dir a fixed one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    with mock.patch.dict(os.environ, {**env, "XDG_RUNTIME_DIR": "/ckptd-docs-run", **values}, clear=True):
        yield


@dataclasses.dataclass(frozen=True)
class Read:
    """One read of a ``CKPTD_*`` variable in ``ckptd/``: where, and the default the code gives it there."""

    var: str
    default: Any  # None where there is none
    path: str  # relative to the repository
    function: str | None  # the innermost function around it; None at module level (read at import)


@functools.cache
def _env_reads() -> tuple[Read, ...]:
    """Every read: a call of ``os.environ.get`` / ``os.getenv`` / ``env_int`` / ``env_float`` / ``_env`` with the
    name as first argument (the second argument, or the constant after ``or``, is the default)."""
    reads = []
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        tree = ast.parse(path.read_text(), rel)
        after_or = {
            id(v): node.values[-1].value
            for node in ast.walk(tree)
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and isinstance(node.values[-1], ast.Constant)
            for v in node.values[:-1]
        }
        todo: list[tuple[ast.AST, str | None]] = [(tree, None)]
        while todo:
            node, function = todo.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                function = node.name
            todo += [(child, function) for child in ast.iter_child_nodes(node)]
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            name = node.args[0].value
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if not isinstance(name, str) or not VAR_RE.fullmatch(name) or func not in ENV_READERS:
                continue
            default: Any = after_or.get(id(node))
            if len(node.args) > 1:
                arg = node.args[1]
                if isinstance(arg, ast.Name):
                    where = f"{rel}:{node.lineno}"
                    assert hasattr(config, arg.id), f"{where}: the default of {name}, {arg.id}, is not a constant of ckptd.config"
                    default = getattr(config, arg.id)
                else:
                    default = ast.literal_eval(arg)
            reads.append(Read(name, default, rel, function))
    return tuple(reads)


def _daemon_only(read: Read) -> bool:
    """Read only by the daemon: in ckptd/daemon/, or where config.py reads the daemon's settings."""
    return read.path.startswith("ckptd/daemon/") or (read.path == "ckptd/config.py" and read.function == "_from_env")


@functools.cache
def _setters() -> dict[str, frozenset[str]]:
    """Top-level TOML key -> the variables that set it: each variable read is set, in turn, to a value other
    than the key's default, and ``daemon_config`` says whether the key changed."""
    defaults = _actual_defaults()
    with _environ(CKPTD_ROOT=BASE_ROOT):
        base = daemon_config()
    out = {}
    for key in config.SERVE_KEYS:
        probe = _a_group() if key == "group" else PROBES.get(key)
        if probe is None:
            d = defaults[("", key)]
            assert isinstance(d, int | float), f"no value to set {key!r} to: add one to PROBES"
            probe = str(int(not d) if isinstance(d, bool) else int(d) + 1)
        setters = set()
        for var in {r.var for r in _env_reads()}:
            try:
                with _environ(**{"CKPTD_ROOT": BASE_ROOT, var: probe}):
                    cfg = daemon_config()
            except ValueError:
                continue  # not a value this variable takes: not this key's
            if getattr(cfg, key) != getattr(base, key):
                setters.add(var)
        out[key] = frozenset(setters)
    return out


def _named_vars() -> set[str]:
    """Every ``CKPTD_*`` name in ``ckptd/`` (reads, docstrings, error messages that tell the user to set one)."""
    return {m for path in PKG.rglob("*.py") for m in VAR_RE.findall(path.read_text())}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


@functools.cache
def _actual_defaults() -> dict[tuple[str, str], Any]:
    """(section, key) -> the value ``daemon_config`` gives it with no variable set and a file holding only
    ``root`` and ``[remote] bucket``."""
    with tempfile.TemporaryDirectory() as tmp, _environ():
        path = Path(tmp) / "ckptd.toml"
        path.write_text(f'root = "{BASE_ROOT}"\n[remote]\nbucket = "docs-probe"\n')
        cfg = daemon_config(None, str(path))
    out = {("", k): getattr(cfg, k) for k in config.SERVE_KEYS}
    out |= {("remote", f.name): getattr(cfg.remote, f.name) for f in dataclasses.fields(RemoteConfig)}
    out |= {("remote", k): getattr(cfg, field) for k, (field, _) in config._REMOTE_TIER_KEYS.items()}
    return out | {("remote", "path"): None}  # a shared directory instead of the bucket: required where it is the tier


def _remote_path_setters() -> frozenset[str]:
    """The variables that make a shared directory the ``[remote]`` tier (``path``), probed as :func:`_setters` does."""
    found = set()
    for var in {r.var for r in _env_reads()}:
        try:
            with _environ(**{"CKPTD_ROOT": BASE_ROOT, var: "/probe/shared"}):
                cfg = daemon_config()
        except ValueError:
            continue
        if isinstance(cfg.remote, DirConfig) and cfg.remote.path == "/probe/shared":
            found.add(var)
    return frozenset(found)


def _prose_defaults() -> set[tuple[str, str]]:
    """Keys whose default is ``None`` or required in the code: the page says what happens in words."""
    unset = (None, dataclasses.MISSING)
    out = {("", f.name) for f in dataclasses.fields(DaemonConfig) if f.default in unset}
    out |= {("remote", f.name) for f in dataclasses.fields(DirConfig) if f.default in unset}
    return out | {("remote", f.name) for f in dataclasses.fields(RemoteConfig) if f.default in unset}


# ---------------------------------------------------------------------------- the checks


def configuration_problems(text: str) -> list[str]:
    """What docs/configuration.md (``text``) lacks or gets wrong against ckptd/config.py and the serve parser."""
    problems: list[str] = []
    daemon, client = _table(text, DAEMON_HEADER), _table(text, CLIENT_HEADER)
    serve = {a.dest: a for a in _options(_subparsers()["serve"])}
    defaults, prose = _actual_defaults(), _prose_defaults()
    reads = _env_reads()

    # every key a row, once; every row a real key
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for row in daemon:
        key = _toml_key(row["TOML key"])
        if key is None:
            continue
        if key in rows:
            problems.append(f"two rows for TOML key {key}")
        elif key not in defaults:
            problems.append(f"a row for TOML key {key}, which ckptd.config does not read")
        rows[key] = row
    for key in sorted(set(defaults) - set(rows)):
        problems.append(f"no row for TOML key {key[1]!r}" + (f" in [{key[0]}]" if key[0] else ""))

    # flags: each its row (the one of the key it sets), and none that the parser lacks
    flags_in_rows = [f for row in daemon for f in FLAG_RE.findall(row["`ckptd serve` flag"])]
    for action in serve.values():
        missing = set(action.option_strings) - set(flags_in_rows)
        if missing:
            problems.append(f"no row for `ckptd serve` {', '.join(sorted(missing))}")
    real_flags = {s for a in serve.values() for s in a.option_strings}
    for flag in sorted(set(flags_in_rows) - real_flags):
        problems.append(f"a row for `ckptd serve` {flag}, which the parser does not have")
    for key, row in rows.items():
        want = set(serve[key[1]].option_strings) if not key[0] and key[1] in serve else set()
        if key == ("remote", "path"):
            want = set(serve["remote_path"].option_strings)
        got = set(FLAG_RE.findall(row["`ckptd serve` flag"]))
        if got != want and not (got - real_flags):
            problems.append(f"the row of {key[1]!r} names the flags {sorted(got)}; the parser's are {sorted(want)}")

    # defaults: a TOML literal equal to daemon_config's, or words where the code has none
    for key, row in rows.items():
        if key not in defaults:
            continue
        written = _literal(row["default"])
        if key in prose:
            if written is not NO_LITERAL:
                problems.append(f"the default of {key[1]!r} is None or required in the code; the page gives {written!r}")
        elif written is NO_LITERAL or not _same(written, defaults[key]):
            problems.append(f"the default of {key[1]!r} is {defaults[key]!r} in the code; the page gives {row['default']!r}")

    # variables: a key's row names exactly the variables that set it; every read has a row in the table of the
    # side that reads it; no row names a variable nothing reads
    setters = _setters()
    for key, row in rows.items():
        listed = set(VAR_RE.findall(row["environment variable"]))
        want = set(setters.get(key[1], ())) if not key[0] else set(_remote_path_setters()) if key == ("remote", "path") else set()
        if listed != want:
            problems.append(f"the row of {key[1]!r} names {sorted(listed)}; the variables that set it are {sorted(want)}")
    daemon_vars = {v for row in daemon for v in VAR_RE.findall(row["environment variable"])}
    client_vars = {v for row in client for v in VAR_RE.findall(row["environment variable"])}
    for r in reads:
        if r.function is None or _daemon_only(r):  # read at import (in every process), or by the daemon's settings
            if r.var not in daemon_vars:
                problems.append(f"{r.var} ({r.path}, {r.function or 'at import'}) has no row in the daemon's table")
        if not _daemon_only(r) and r.var not in client_vars:
            problems.append(f"{r.var} ({r.path}, {r.function or 'at import'}) has no row in the trainer's table")
    for var in sorted(_named_vars() - daemon_vars - client_vars):
        problems.append(f"{var} is named in ckptd/ but has no row")
    for var in sorted((daemon_vars | client_vars) - {r.var for r in reads}):
        problems.append(f"{var} has a row but nothing in ckptd/ reads it")

    # defaults of the variables without a TOML key: as the code reads them
    read_defaults: dict[str, set[Any]] = {}
    for r in reads:
        read_defaults.setdefault(r.var, set()).add(r.default)
    for row in daemon + client:
        if row in daemon and (_toml_key(row["TOML key"]) is not None or FLAG_RE.search(row["`ckptd serve` flag"])):
            continue  # a key's row (checked above), or --config
        names = VAR_RE.findall(row["environment variable"])
        if len(names) != 1:
            problems.append(f"a row with no flag and no TOML key names one variable, not {names}: {row}")
            continue
        var = names[0]
        code = {d for d in read_defaults.get(var, set()) if d is not None}
        written = _literal(row["default"])
        if written is not NO_LITERAL and not any(_same(written, d) for d in code):
            problems.append(f"the default of {var} is {sorted(map(repr, code))} in the code; the page gives {row['default']!r}")
        set_by_daemon = any(var in v for v in setters.values())  # the trainer's copy defaults to the daemon's setting
        if written is NO_LITERAL and len(code) == 1 and not set_by_daemon:
            problems.append(f"the default of {var} is {next(iter(code))!r} in the code; the page gives {row['default']!r}")

    # the Client argument column names real parameters
    init = next(
        n
        for cls in ast.walk(ast.parse((PKG / "client" / "client.py").read_text()))
        if isinstance(cls, ast.ClassDef) and cls.name == "Client"
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    params = {a.arg for a in init.args.args + init.args.kwonlyargs}
    for row in client:
        for arg in re.findall(r"`([^`]+)`", row["`Client` argument"]):
            if arg not in params:
                problems.append(f"the row of {row['environment variable']} names Client({arg}=...), which Client does not take")
    return list(dict.fromkeys(problems))  # one line per problem, however many reads found it


def _sections(text: str) -> dict[str, str]:
    """``## `ckptd <command>` `` heading -> the text up to the next ``##``."""
    parts = re.split(r"^## ", text, flags=re.M)
    out = {}
    for part in parts[1:]:
        m = re.match(r"`ckptd ([a-z]+)`", part)
        if m:
            out[m.group(1)] = part
    return out


def _synopsis(section: str, command: str) -> list[str]:
    """The ``ckptd <command> ...`` lines (with their indented continuations) of a section's code blocks, less comments."""
    lines, inside, usage = [], False, False
    for line in section.splitlines():
        if line.startswith("```"):
            inside, usage = not inside, False
            continue
        if inside:
            usage = line.startswith(f"ckptd {command} ") or (usage and line[:1].isspace())
            if usage:
                lines.append(line.split("#")[0])
    return lines


def _shown_choices(synopsis: list[str], flag: str) -> set[str]:
    """The values a synopsis shows after ``flag`` (``--what model|optim|all``, ``--lagging {wait,memory}``)."""
    found = re.findall(rf"(?<![\w-]){re.escape(flag)} \{{?([\w|,.-]+)", " ".join(synopsis))
    return {v for values in found for v in re.split(r"[|,]", values)}


def cli_problems(text: str) -> list[str]:
    """What docs/cli.md (``text``) lacks against the parser: a section per command naming its options and
    positionals, a synopsis showing every choice of an option, and no flag there that the command lacks."""
    problems: list[str] = []
    sections = _sections(text)
    commands = _subparsers()
    for name in sorted(set(sections) - set(commands)):
        problems.append(f"a section for `ckptd {name}`, which the parser does not have")
    for name, parser in commands.items():
        if name not in sections:
            problems.append(f"no section for `ckptd {name}`")
            continue
        section = sections[name]
        synopsis = _synopsis(section, name)
        for action in _options(parser):
            words = action.option_strings or [action.metavar or action.dest.upper()]
            for word in words:
                if not re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", section):
                    problems.append(f"`ckptd {name}` {word} is not in its section")
            for choice in sorted(set(action.choices or ()) - _shown_choices(synopsis, words[0])):
                problems.append(f"the synopsis of `ckptd {name}` does not show {words[0]} {choice}")
        real = {s for a in _options(parser) for s in a.option_strings}
        for flag in sorted({f for line in synopsis for f in FLAG_RE.findall(line)} - real):
            problems.append(f"the synopsis of `ckptd {name}` shows {flag}, which it does not take")
    return problems


# ---------------------------------------------------------------------------- tests


def test_configuration_page_matches_the_code() -> None:
    problems = configuration_problems(CONFIGURATION.read_text())
    assert not problems, "docs/configuration.md:\n" + "\n".join(problems)


def test_cli_page_matches_the_parser() -> None:
    problems = cli_problems(CLI.read_text())
    assert not problems, "docs/cli.md:\n" + "\n".join(problems)


def test_env_reads_are_found() -> None:
    """The walker finds reads of each shape (a direct get, a reader with a constant, ``or`` a default, at import)."""
    reads = {(r.var, r.function): r.default for r in _env_reads()}
    assert reads[("CKPTD_ROOT", "_from_env")] is None
    assert reads[("CKPTD_SHM_DIR", None)] == "/dev/shm"
    assert reads[("CKPTD_KEEP", "_from_env")] == config.KEEP
    assert reads[("CKPTD_OVERLAP", "overlap_setting")] == "auto"
    assert _setters()["endpoint"] == {"CKPTD_ENDPOINT"} and _setters()["shm_budget"] == set()


def _rows(text: str) -> list[str]:
    """The lines of the two tables' rows."""
    headers = {"| " + " | ".join(h) + " |" for h in (DAEMON_HEADER, CLIENT_HEADER)}
    return [line for line in text.splitlines() if line.startswith("| ") and line not in headers]


@pytest.mark.parametrize("row", _rows(CONFIGURATION.read_text()), ids=lambda row: row.split(" | ")[1][:40])
def test_configuration_check_catches_a_missing_row(row: str) -> None:
    text = CONFIGURATION.read_text()
    assert configuration_problems(text.replace(row + "\n", "")) != []


def test_configuration_check_catches_a_wrong_default() -> None:
    text = CONFIGURATION.read_text()
    assert "| `keep_every` in `[remote]` | — | `0` |" in text
    problems = configuration_problems(text.replace("| `keep_every` in `[remote]` | — | `0` |", "| `keep_every` in `[remote]` | — | `1` |"))
    assert problems == ["the default of 'keep_every' is 0 in the code; the page gives '`1`'"]


def test_configuration_check_catches_a_wrong_variable() -> None:
    text = CONFIGURATION.read_text()
    assert "| `workers` | `CKPTD_WORKERS` |" in text
    problems = configuration_problems(text.replace("| `workers` | `CKPTD_WORKERS` |", "| `workers` | `CKPTD_KEEP` |"))
    assert "the row of 'workers' names ['CKPTD_KEEP']; the variables that set it are ['CKPTD_WORKERS']" in problems
    assert "CKPTD_WORKERS (ckptd/config.py, _from_env) has no row in the daemon's table" in problems


def _cli_cases() -> list[tuple[str, str]]:
    cases = []
    for name, parser in _subparsers().items():
        cases.append((name, ""))
        cases += [(name, s) for a in _options(parser) for s in a.option_strings or [a.metavar or a.dest.upper()]]
    return cases


@pytest.mark.parametrize(("command", "word"), _cli_cases(), ids=lambda v: v or "section")
def test_cli_check_catches_a_missing_flag(command: str, word: str) -> None:
    """The command's section removed (``word`` empty), or one word removed from it."""
    text = CLI.read_text()
    section = _sections(text)[command]
    gone = "" if not word else re.sub(rf"(?<![\w-]){re.escape(word)}(?![\w-])", "", section)
    assert cli_problems(text.replace(section, gone)) != []


def test_cli_check_catches_a_missing_choice_and_an_unknown_flag() -> None:
    text = CLI.read_text()
    assert "--what model|optim|all" in text and "[--format safetensors|torch]" in text
    assert cli_problems(text.replace("--what model|optim|all", "--what model|all")) == [
        "the synopsis of `ckptd export` does not show --what optim"
    ]
    assert cli_problems(text.replace("[--format safetensors|torch]", "[--format safetensors|torch] [--fmt F]")) == [
        "the synopsis of `ckptd export` shows --fmt, which it does not take"
    ]
