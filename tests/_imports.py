"""The import graph of a package, read from its source: every ``import`` and ``from ... import`` of one of its own
modules, at module level or inside a function (those count: a cycle dodged by a late import is still a cycle), but
not under ``if TYPE_CHECKING:`` (never run). Used by ``tests/test_architecture.py``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    """``ckptd.client.load`` for ``<root>/ckptd/client/load.py``; a package is named by its ``__init__``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for body in node.body for n in ast.walk(body))
    return skip


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            pkg = ".".join(base + ([node.module] if node.module else []))
        else:
            pkg = node.module or ""
        subs = [f"{pkg}.{a.name}" for a in node.names if f"{pkg}.{a.name}" in known]
        names = subs + ([pkg] if len(subs) < len(node.names) else [])  # names that are not modules come from pkg
    else:
        return
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            yield ".".join(parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself excluded)."""
    files = {module_name(root, p): p for p in sorted((root / package).rglob("*.py"))}
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) not in skip:
                graph[module].update(t for t in _imported(module, path.name == "__init__.py", node, known) if t != module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out
