"""The daemon's wiring is explicit (issue 36): every component gets what it calls when it is made, so reading
``Daemon.__init__`` and the ``_wire_*`` methods it calls shows who calls whom. Checked on the source: nothing in
``ckptd/daemon`` assigns onto another object's attributes after it was made (``self.admission.writing = ...``), and no
constructor patches an object it was given (``pool.reclaim = self.reclaim``)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = node.targets
    elif isinstance(node, ast.AnnAssign):
        found = [node.target]
    else:
        return []
    return [e for t in found for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def patched_from_outside(source: str) -> list[str]:
    """Assignments onto another object: ``self.<part>.<attr> = ...`` (a collaborator's attribute; the object's own
    private parts, ``self._<part>``, are its own), and, in a constructor, ``<argument>.<attr> = ...``."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        given = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}
        for node in ast.walk(fn):
            for t in _targets(node):
                if not isinstance(t, ast.Attribute):
                    continue
                v = t.value
                on_self = isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
                held = on_self and not v.attr.startswith("_")  # type: ignore[union-attr]
                argument = fn.name == "__init__" and isinstance(v, ast.Name) and v.id in given
                if held or argument:
                    out.append(f"line {node.lineno}: {ast.unparse(t)}")
    return out


def test_no_daemon_component_is_wired_by_assigning_onto_it_after_it_was_made() -> None:
    daemon = sorted((Path(REPO) / "ckptd" / "daemon").glob("*.py"))
    found = {str(p.relative_to(REPO)): bad for p in daemon if (bad := patched_from_outside(p.read_text()))}
    assert found == {}, f"pass these as constructor arguments instead: {found}"


def test_the_check_catches_the_patterns_it_forbids() -> None:
    code = """
class Daemon:
    def _wire(self):
        self.admission.writing = self.persister.writing
        self.memtier = self.completion.memory = Tier()
        self._tls.push = 1  # (its own private part: allowed)
        self.counters.steps += 1  # (a count kept in a record: allowed)

class Tier:
    def __init__(self, pool, steps):
        pool.reclaim, pool.soon = self.reclaim, self.sealing
        self.steps = steps
"""
    assert patched_from_outside(code) == [
        "line 4: self.admission.writing",
        "line 5: self.completion.memory",
        "line 11: pool.reclaim",
        "line 11: pool.soon",
    ]
