"""The public API's docstrings, checked: one Google style, as napoleon reads it for docs/reference.md.

Each public callable (the functions in ``ckptd.__all__``; the public methods of ``Client``, ``SnapshotHandle`` and
``Restored``; the constructors of ``Client``, ``ckptd.dcp.Writer`` / ``Reader`` and the three integration classes,
documented in the class docstring; the integration methods users and frameworks call) has a one-line summary, an
``Args:`` section naming each parameter (``*args`` / ``**kwargs`` as written so) and no parameter it lacks, a
``Returns:`` section exactly when its annotation says it returns something other than ``None`` (its first line free of
a colon napoleon would read as a type), and a ``Raises:`` section naming only exceptions (``ckptd.errors`` or
built-in). The ``*_catches_*`` tests hand the checker broken docstrings, and the real ``ckptd.restore`` stripped of
its own, and require a problem: no check passes vacuously.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest

import ckptd
import ckptd.dcp
from ckptd import errors

SECTION_RE = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")  # a Google section header, at the docstring's own indentation
ENTRY_RE = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)\s*(\([^)]*\))?:(\s+\S.*)?$")  # "name:" / "name (type): text"
# napoleon splits a Returns section's first line on a colon outside ``literals`` and :roles:`targets`: "type: text"
ROLE_OR_LITERAL_RE = re.compile(r"``.+?``|:[\w:]+:`[^`]*`|`[^`]*`")
SINGLE_COLON_RE = re.compile(r"(?<!:):(?!:)")

# (module, class) whose constructor users call; the class docstring documents its arguments
CONSTRUCTORS = [
    ("ckptd", "Client"),
    ("ckptd.dcp", "Writer"),
    ("ckptd.dcp", "Reader"),
    ("ckptd.integrations.lightning", "CkptdCheckpointIO"),
    ("ckptd.integrations.hf", "CkptdCallback"),
    ("ckptd.integrations.torchtitan", "CkptdCheckpointManager"),
]
CLASSES_WITH_PUBLIC_METHODS = ["Client", "SnapshotHandle", "Restored"]  # every public method they define
INTEGRATION_METHODS = [
    ("ckptd.integrations.lightning", "CkptdCheckpointIO", "save_checkpoint"),
    ("ckptd.integrations.lightning", "CkptdCheckpointIO", "load_checkpoint"),
    ("ckptd.integrations.lightning", "CkptdCheckpointIO", "remove_checkpoint"),
    ("ckptd.integrations.hf", "CkptdCallback", "bind"),
    ("ckptd.integrations.hf", "CkptdCallback", "resume_checkpoint"),
]
FRAMEWORK = {  # the package an integration module needs
    "ckptd.integrations.lightning": "lightning_fabric",
    "ckptd.integrations.hf": "transformers",
    "ckptd.integrations.torchtitan": "torchtitan",
}


# ---------------------------------------------------------------------------- reading a docstring


def sections(doc: str) -> dict[str, list[str]]:
    """Section header -> its body's lines, dedented (the text before the first header is ``""``)."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in inspect.cleandoc(doc).splitlines():
        m = SECTION_RE.match(line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
        elif current and line.strip() and not line[:1].isspace():
            current = ""  # text back at the docstring's indentation ends a section
            out[""].append(line)
        else:
            out[current].append(line)
    body = {name: lines for name, lines in out.items() if name}
    return {"": out[""], **{name: _dedent(lines) for name, lines in body.items()}}


def _dedent(lines: list[str]) -> list[str]:
    indents = [len(x) - len(x.lstrip()) for x in lines if x.strip()]
    cut = min(indents, default=0)
    return [x[cut:] for x in lines]


def entries(body: list[str]) -> dict[str, str]:
    """A section's ``name: text`` entries (the lines at its first indentation); a line that is not one maps ``""``."""
    out = {}
    for line in body:
        if not line.strip() or line[:1].isspace():
            continue  # a continuation of the entry above
        m = ENTRY_RE.match(line)
        out[m.group(1) if m else line] = (m.group(3) or "").strip() if m else ""
    return out


# ---------------------------------------------------------------------------- the check


def docstring_problems(obj: Any, *, constructor: bool = False) -> list[str]:
    """What the docstring of ``obj`` (a function, or with ``constructor`` a class: its docstring documents
    ``__init__``) lacks or gets wrong."""
    func = obj.__init__ if constructor else obj
    doc = obj.__dict__.get("__doc__") if constructor else getattr(obj, "__doc__", None)  # never an inherited one
    if not doc or not doc.strip():
        return ["no docstring"]
    problems = []
    found = sections(doc)
    lines = inspect.cleandoc(doc).splitlines()
    if len(lines) > 1 and lines[1].strip():
        problems.append("the summary is not one line followed by a blank line")
    params = _parameters(func)
    args = entries(found.get("Args", []))
    if params and "Args" not in found:
        problems.append(f"no Args: section (parameters {', '.join(params)})")
    for name in params:
        if name not in args:
            problems.append(f"Args: does not name {name}")
        elif not args[name]:
            problems.append(f"Args: names {name} without saying what it is")
    for name in sorted(set(args) - set(params)):
        problems.append(f"Args: names {name!r}, which is not a parameter")
    if not constructor:
        problems += _returns_problems(func, found)
    for name in entries(found.get("Raises", [])):
        exc = getattr(errors, name, None) or getattr(builtins, name, None)
        if not (isinstance(exc, type) and issubclass(exc, BaseException)):
            problems.append(f"Raises: names {name!r}, which is neither in ckptd.errors nor a built-in exception")
    return problems


def _parameters(func: Callable[..., Any]) -> list[str]:
    """Its parameters as an Args: section names them: no self / cls, ``*args``, ``**kwargs``."""
    names = []
    for i, p in enumerate(inspect.signature(func).parameters.values()):
        if i == 0 and p.name in ("self", "cls"):
            continue
        stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(stars + p.name)
    return names


def _returns_problems(func: Callable[..., Any], found: dict[str, list[str]]) -> list[str]:
    annotation = inspect.signature(func).return_annotation
    if annotation is inspect.Signature.empty:
        return ["no return annotation: cannot tell whether it needs a Returns: section"]
    returns_none = annotation in (None, "None")
    body = [x for x in found.get("Returns", []) if x.strip()]
    if returns_none:
        return ["a Returns: section, but it returns None"] if "Returns" in found else []
    if not body:
        return [f"no Returns: section (it returns {annotation})"]
    if SINGLE_COLON_RE.search(ROLE_OR_LITERAL_RE.sub("", body[0])):
        return [f"napoleon reads the Returns: line {body[0]!r} as 'type: text' (the colon)"]
    return []


# ---------------------------------------------------------------------------- what is checked


def _public_methods(cls: type) -> list[str]:
    """The public methods ``cls`` and its ckptd bases define (not a base from elsewhere: ``Restored`` is a dict)."""
    out: list[str] = []
    for klass in cls.__mro__:
        if not klass.__module__.startswith("ckptd"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in out:
                continue
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            if inspect.isfunction(value):
                out.append(name)
    return out


def _targets() -> list[tuple[str, str, str | None, bool]]:
    """``(id, module, qualified name, constructor)`` of every callable checked."""
    out = []
    for name in ckptd.__all__:
        if inspect.isfunction(getattr(ckptd, name)):
            out.append((f"ckptd.{name}", "ckptd", name, False))
    for cls_name in CLASSES_WITH_PUBLIC_METHODS:
        for meth in _public_methods(getattr(ckptd, cls_name)):
            out.append((f"ckptd.{cls_name}.{meth}", "ckptd", f"{cls_name}.{meth}", False))
    out += [(f"{mod}.{cls}()", mod, cls, True) for mod, cls in CONSTRUCTORS]
    out += [(f"{mod}.{cls}.{meth}", mod, f"{cls}.{meth}", False) for mod, cls, meth in INTEGRATION_METHODS]
    return out


TARGETS = _targets()


def _resolve(module: str, qualname: str) -> Any:
    if module in FRAMEWORK:
        pytest.importorskip(FRAMEWORK[module])
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
        if isinstance(obj, (classmethod, staticmethod)):
            obj = obj.__func__
    return obj


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("module", "qualname", "constructor"), [t[1:] for t in TARGETS], ids=[t[0] for t in TARGETS])
def test_public_docstring(module: str, qualname: str, constructor: bool) -> None:
    assert docstring_problems(_resolve(module, qualname), constructor=constructor) == []


def test_the_targets_cover_the_public_api() -> None:
    """Found from ``__all__`` and the classes, not listed by hand: none may drop out unnoticed."""
    ids = {t[0] for t in TARGETS}
    functions = {"ckptd.snapshot", "ckptd.restore", "ckptd.wait", "ckptd.latest", "ckptd.prepare"}
    methods = {f"ckptd.Client.{m}" for m in ("snapshot", "restore", "wait", "prepare", "latest", "protect", "unprotect")}
    assert functions | methods | {"ckptd.SnapshotHandle.wait", "ckptd.dcp.Writer()", "ckptd.dcp.Reader()"} <= ids


def _undocumented(a: int) -> int:
    return a


def _good(a: int, *rest: int, b: str = "", **kw: Any) -> int:
    """Add up.

    Args:
        a: The first.
        *rest: The others.
        b: A label.
        **kw: Passed on.

    Returns:
        The sum, as an ``int``.

    Raises:
        ValueError: ``a`` is negative.
        CheckpointError: Never, but it could.
    """
    return a


def _no_args(a: int) -> int:
    """Add up.

    Returns:
        The sum."""
    return a


def _no_returns(a: int) -> int:
    """Add up.

    Args:
        a: The first."""
    return a


def _stale_and_empty(a: int, b: int) -> None:
    """Add up.

    Args:
        a:
        c: Gone."""


def _returns_a_type(a: int) -> int:
    """Add up.

    Args:
        a: The first.

    Returns:
        The :class:`int`: the sum."""
    return a


def _returns_none_yet_says_so(a: int) -> None:
    """Add up.
    More summary.

    Args:
        a: The first.

    Returns:
        Nothing.

    Raises:
        NoSuchError: Never."""


def test_the_check_passes_a_good_docstring() -> None:
    assert docstring_problems(_good) == []


@pytest.mark.parametrize(
    ("func", "problems"),
    [
        (_undocumented, ["no docstring"]),
        (_no_args, ["no Args: section (parameters a)", "Args: does not name a"]),
        (_no_returns, ["no Returns: section (it returns int)"]),
        (
            _stale_and_empty,
            ["Args: names a without saying what it is", "Args: does not name b", "Args: names 'c', which is not a parameter"],
        ),
        (_returns_a_type, ["napoleon reads the Returns: line 'The :class:`int`: the sum.' as 'type: text' (the colon)"]),
        (
            _returns_none_yet_says_so,
            [
                "the summary is not one line followed by a blank line",
                "a Returns: section, but it returns None",
                "Raises: names 'NoSuchError', which is neither in ckptd.errors nor a built-in exception",
            ],
        ),
    ],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_the_check_catches_a_broken_docstring(func: Callable[..., Any], problems: list[str]) -> None:
    assert docstring_problems(func) == problems


def test_the_check_catches_a_public_function_stripped_of_its_docstring(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ``ckptd.restore``: without its docstring, and with only its summary and Raises: section left."""
    doc = ckptd.restore.__doc__
    assert doc and docstring_problems(ckptd.restore) == []
    monkeypatch.setattr(ckptd.restore, "__doc__", None)
    assert docstring_problems(ckptd.restore) == ["no docstring"]
    found = sections(doc)
    summary = inspect.cleandoc(doc).splitlines()[0]
    monkeypatch.setattr(ckptd.restore, "__doc__", "\n".join([summary, "", "Raises:", *("    " + x for x in found["Raises"])]))
    params = ["model", "optim", "step", "path", "hot", "strict", "dtype", "rename"]
    assert docstring_problems(ckptd.restore) == [
        f"no Args: section (parameters {', '.join(params)})",
        *(f"Args: does not name {p}" for p in params),
        "no Returns: section (it returns Restored)",
    ]


def test_the_check_catches_a_constructor_argument_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = ckptd.dcp.Writer.__doc__
    assert doc and "    durable:" in doc
    monkeypatch.setattr(ckptd.dcp.Writer, "__doc__", re.sub(r"\n *durable:[^\n]*", "", doc))
    assert docstring_problems(ckptd.dcp.Writer, constructor=True) == ["Args: does not name durable"]
