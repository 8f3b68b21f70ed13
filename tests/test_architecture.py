"""The architecture's rules, checked: layers that import only downwards and no import cycles, modules that say
their job, short functions, one home for each name, and no torch where none is needed (the daemon, the CLI's
``status`` and ``ls``)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _imports import cycles, import_graph
from conftest import REPO

PACKAGE = REPO / "ckptd"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 60  # longer only with a "# long: <why>" comment on the line above the def


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_says_its_job(path: Path) -> None:
    text = path.read_text()
    if path.name != "__main__.py":
        assert ast.get_docstring(ast.parse(text)), f"{_rel(path)} has no opening docstring saying what it does"


def test_no_long_functions() -> None:
    long = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if n > MAX_FUNCTION_LINES and "# long:" not in lines[first - 2]:
                    long.append(f"{_rel(path)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


# literals that spell a name or path of the on-disk and bucket layout live in ckptd/layout.py, the key
# escaping in ckptd/state.py, and "is this step complete?" in layout (local) and storage/remote (bucket)
ONE_HOME = {
    r"rank-\{": {"ckptd/layout.py"},
    r"rank-\(": {"ckptd/layout.py"},
    r'"manifest\.json"': {"ckptd/layout.py"},
    r"step-\{": {"ckptd/layout.py"},
    r"exists\([^)]*MANIFEST": {"ckptd/layout.py"},
    r"%2F": {"ckptd/state.py"},
}


@pytest.mark.parametrize("pattern", ONE_HOME)
def test_each_layout_name_is_spelled_in_one_module(pattern: str) -> None:
    homes = {_rel(p) for p in MODULES if re.search(pattern, p.read_text())}
    assert homes == ONE_HOME[pattern], f"{pattern!r} spelled in {sorted(homes)}"


def test_every_wire_op_has_exactly_one_handler() -> None:
    from ckptd.daemon.server import OPS, Daemon
    from ckptd.protocol import SCHEMA

    assert sorted(OPS) == sorted(SCHEMA) and len(set(OPS)) == len(OPS)
    assert all(callable(getattr(Daemon, f"_op_{op}", None)) for op in OPS)
    handlers = {name[len("_op_") :] for name in vars(Daemon) if name.startswith("_op_")}
    assert handlers == set(OPS), handlers ^ set(OPS)  # no handler left that no op reaches


def _modules_after(code: str, *args: str) -> set[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_the_daemon_and_storage_packages_never_import_torch() -> None:
    code = (
        "import sys, pkgutil, importlib, ckptd.daemon, ckptd.storage\n"
        "for pkg in (ckptd.daemon, ckptd.storage):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__): importlib.import_module(pkg.__name__ + '.' + m.name)\n"
        "import ckptd.cli, ckptd.config, ckptd.layout, ckptd.format, ckptd.protocol, ckptd.client.rpc, ckptd.storage.verify\n"
        "print(' '.join(sys.modules))"
    )
    loaded = _modules_after(code)
    assert "ckptd.daemon.server" in loaded and "ckptd.storage.s3" in loaded
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}


def test_cli_status_and_ls_do_not_import_torch(tmp_path: Path) -> None:
    """``python -X importtime`` lists every module imported; ``ls`` runs for real on a root of its own."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for args in (["status", "--help"], ["ls", "--root", str(tmp_path)]):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "ckptd", *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
        assert "ckptd.cli" in imported
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, args


def test_every_subpackage_is_packaged() -> None:
    """A wheel (``pip install .``, the device's carried wheels) holds every subpackage, not only ``ckptd``."""
    import tomllib

    from setuptools import find_packages

    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(REPO), include=conf["include"]))
    packages = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
    assert {"ckptd", "ckptd.client", "ckptd.daemon", "ckptd.storage", "ckptd.tools"} <= packages <= found


# ---------------------------------------------------------------------------- layers

TOP = {"ckptd", "ckptd.cli", "ckptd.__main__"}  # the public functions and the command line: they may use anything
SUBPACKAGES = ("client", "daemon", "storage", "tools", "dcp", "integrations")
# what each layer may import; "core" is every module right under ckptd/ but the top ones (errors, config, layout,
# format, protocol, state, validate, coverage, shm, files, s3config, version): they import only each other
MAY_IMPORT = {
    "core": {"core"},
    "storage": {"core", "storage"},
    "client": {"core", "storage", "client"},
    "daemon": {"core", "storage", "daemon"},
    "tools": {"core", "storage", "client", "tools"},
    "dcp": {"core", "storage", "client", "dcp"},
    "integrations": {"core", "storage", "client", "dcp", "integrations"},
}


def layer(module: str) -> str:
    if module in TOP:
        return "top"
    part = module.split(".")[1]
    return part if part in SUBPACKAGES else "core"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({layer(a)}) imports {b} ({layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer(a) != "top" and layer(b) not in MAY_IMPORT[layer(a)]
    )


def test_layers_import_only_downwards() -> None:
    """Core imports nothing above it; storage no client, daemon or tools; client and daemon never each other; tools
    no daemon; dcp and the integrations only the client side. Imports inside functions count."""
    assert layer_violations(import_graph(REPO, "ckptd")) == []


def test_no_import_cycles() -> None:
    """Not even through an import inside a function (``if TYPE_CHECKING:`` imports aside)."""
    assert cycles(import_graph(REPO, "ckptd")) == []


# the one client module the adapters (dcp, integrations) may import: the internal API its docstring documents
CLIENT_API = "ckptd.client.api"
ADAPTERS = ("dcp", "integrations")


def client_api_violations(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({layer(a)}) imports {b}, not {CLIENT_API}"
        for a, targets in graph.items()
        for b in targets
        if layer(a) in ADAPTERS and layer(b) == "client" and b != CLIENT_API
    )


def test_dcp_and_the_integrations_use_only_the_clients_internal_api() -> None:
    """``ckptd.dcp`` and ``ckptd.integrations`` reach the client through ``ckptd.client.api`` alone: no other client
    module, the package itself included. Imports inside functions count (``if TYPE_CHECKING:`` ones aside)."""
    graph = import_graph(REPO, "ckptd")
    assert client_api_violations(graph) == []
    assert any(CLIENT_API in targets for a, targets in graph.items() if layer(a) in ADAPTERS)  # not vacuous


def test_the_client_api_check_catches_an_adapter_reaching_past_it(tmp_path: Path) -> None:
    pkg = tmp_path / "ckptd"
    for d in ("", "client", "dcp", "integrations"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text('"""pkg"""\n')
    for m in ("api", "restore", "plan"):
        (pkg / "client" / f"{m}.py").write_text('"""m"""\n')
    (pkg / "dcp" / "reader.py").write_text("from ..client.api import open_step\ndef f():\n    from ..client.restore import settled\n")
    (pkg / "dcp" / "shared.py").write_text("def f():\n    from ..client import Client\n")  # the package: not the API either
    (pkg / "integrations" / "hf.py").write_text("import ckptd.client.plan\nfrom ckptd.client import api\n")
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..client import restore\n"
    (pkg / "integrations" / "pointer.py").write_text(typing_only)
    assert client_api_violations(import_graph(tmp_path, "ckptd")) == [
        "ckptd.dcp.reader (dcp) imports ckptd.client.restore, not ckptd.client.api",
        "ckptd.dcp.shared (dcp) imports ckptd.client, not ckptd.client.api",
        "ckptd.integrations.hf (integrations) imports ckptd.client.plan, not ckptd.client.api",
    ]  # (pointer's TYPE_CHECKING import is not one)


def test_the_checks_catch_an_upward_import_and_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    pkg = tmp_path / "ckptd"
    for d in ("", "client", "daemon", "storage"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text('"""pkg"""\n')
    (pkg / "errors.py").write_text("def f():\n    from .client import load\n")  # core -> client, late
    (pkg / "client" / "load.py").write_text("from ..storage import local\n")
    (pkg / "storage" / "local.py").write_text("def g():\n    from ..client.load import x\n")  # storage -> client: a cycle
    (pkg / "daemon" / "server.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..client import load\n")
    graph = import_graph(tmp_path, "ckptd")
    assert layer_violations(graph) == [
        "ckptd.errors (core) imports ckptd.client.load (client)",
        "ckptd.storage.local (storage) imports ckptd.client.load (client)",
    ]  # (the daemon's TYPE_CHECKING import is not one)
    assert cycles(graph) == [["ckptd.client.load", "ckptd.storage.local"]]
