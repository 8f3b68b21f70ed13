"""docs/troubleshooting.md against the code: every error class is named there, and every message it quotes is one the
code produces (its literal parts are in the source of the ckptd package)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import NamedTuple

import pytest

import ckptd.errors
from ckptd.daemon.server import OPS

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "troubleshooting.md"
MIN_CHECKED = 12  # a literal piece shorter than this ("s (op ", " of ") proves nothing and is not looked for
JOINT = 5  # characters beside a placeholder left unchecked (see Piece)
# words the code formats from a variable, which the page gives as the user reads them: the template, and its values
VARIABLE_WORDS = {"daemon refused {op}": OPS, "cannot {doing}": ("snapshot", "restore into")}

_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)  # CommonMark: a run of n backticks closes on n
_PLACEHOLDER = re.compile(r"'?<[^<>]+>'?")  # <step>, '<job>' (a value the code formats with !r)
_CLAUSE = re.compile(r"[:;.] ")  # where ckptd joins a message to its cause (f"{what}: {e}", f"{late}. {fix}")
_JOINED = re.compile(r"([\"'])\s+[rRbBfF]{0,2}\1")  # the end of a string literal, whitespace, the start of the next
_CONSTANT = re.compile(r"^([A-Z][A-Z0-9_]*) = \"([^\"\\]*)\"", re.M)  # MANIFEST = "manifest.json"


def _source() -> str:
    """The package's source as one text in which a message's literal parts appear as the user reads them: adjacent
    string literals joined (Python joins them), whitespace collapsed, and ``{NAME}`` of a module's string constant replaced
    by its value (``{MANIFEST}`` by ``manifest.json``)."""
    text = "\n".join(p.read_text() for p in sorted((REPO / "ckptd").rglob("*.py")))
    constants: dict[str, set[str]] = {}
    for name, value in _CONSTANT.findall(text):
        constants.setdefault(name, set()).add(value)
    joined = " ".join(_JOINED.sub("", text).split())
    for name, values in constants.items():
        if len(values) == 1:
            joined = joined.replace("{" + name + "}", values.pop())
    return joined


def _paragraphs() -> list[str]:
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", PAGE.read_text())]


def _quoted_messages() -> list[str]:
    """Every message the page quotes: the code spans (those with a space: not a class name) of each **Message** paragraph."""
    out = []
    for para in _paragraphs():
        if not para.startswith("**Message"):
            continue
        spans = [m.group(2) for m in _CODE_SPAN.finditer(para)]
        spans = [s[1:-1] if len(s) > 2 and s[0] == s[-1] == " " else s for s in spans]  # CommonMark strips one space each side
        quoted = [s for s in spans if " " in s.strip()]
        assert quoted, f"a **Message** paragraph quotes no message: {para[:120]}"
        out += quoted
    return out


class Piece(NamedTuple):
    """A literal piece of a quoted message, and how many characters at each end may be left unchecked: :data:`JOINT`
    beside a placeholder, where the code may have put a computed part of the message (" under" of " under <root>")."""

    text: str
    head: int
    tail: int


def _pieces(message: str) -> list[Piece]:
    """The literal pieces of a quoted message worth looking for: split at its placeholders (and the variable words of
    :data:`VARIABLE_WORDS`), at ``…`` and at clause boundaries, stripped of the punctuation around them."""
    for template, values in VARIABLE_WORDS.items():
        before = template.split("{")[0]
        message = re.sub(re.escape(before) + "(" + "|".join(map(re.escape, values)) + r")\b", before + "<word>", message)
    pieces = []
    parts = _PLACEHOLDER.split(message)
    for k, part in enumerate(parts):
        texts = [clause for chunk in part.split("…") for clause in _CLAUSE.split(chunk)]
        for n, text in enumerate(texts):
            head = JOINT if k > 0 and n == 0 else 0
            tail = JOINT if k < len(parts) - 1 and n == len(texts) - 1 else 0
            pieces.append(Piece(text.strip(" '\"()[],.;:"), head, tail))
    return [p for p in pieces if len(p.text) >= MIN_CHECKED]


def _longest(piece: str, i: int, source: str) -> int:
    """The end of the longest stretch of ``piece`` from ``i`` that is in ``source`` (a binary search: a part of a found one is found)."""
    lo, hi = i, len(piece)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if piece[i:mid] in source else (lo, mid - 1)
    return lo


def _covered(piece: Piece, source: str) -> bool:
    """Whether the piece is in ``source``, or is made of stretches of at least :data:`MIN_CHECKED` characters that are,
    but for the characters its ends may leave unchecked."""
    text = piece.text
    if text in source:
        return True
    for head in range(min(piece.head, len(text)) + 1):
        i = head
        while True:
            j = _longest(text, i, source)
            if j - i < MIN_CHECKED:
                if len(text) - i <= piece.tail:
                    return True
                break
            if j == len(text):
                return True
            i = j
    return False


@pytest.fixture(scope="module")
def source() -> str:
    text = _source()
    for template in VARIABLE_WORDS:
        assert template in text, f"{template!r} is no longer in the code: update VARIABLE_WORDS"
    return text


def test_every_error_class_is_named_on_the_page() -> None:
    text = PAGE.read_text()
    defined = [c for _, c in inspect.getmembers(ckptd.errors, inspect.isclass) if c.__module__ == ckptd.errors.__name__]
    classes = [c for c in defined if issubclass(c, ckptd.errors.CheckpointError)]
    assert len(classes) >= 8, classes  # the module was read, not an empty list
    missing = [c.__name__ for c in classes if not re.search(rf"\b{c.__name__}\b", text)]
    assert not missing, f"error classes not named in {PAGE.name}: {missing}"


def test_every_quoted_message_is_produced_by_the_code(source: str) -> None:
    messages = _quoted_messages()
    assert len(messages) >= 40, f"only {len(messages)} quoted messages found: is the **Message** format still the page's?"
    wrong, vacuous = [], []
    for message in messages:
        pieces = _pieces(message)
        if not pieces:
            vacuous.append(message)
        absent = [p for p in pieces if not _covered(p, source)]
        if absent:
            wrong.append(f"{message}\n    not in ckptd/: {absent}")
    assert not wrong, "messages quoted in docs/troubleshooting.md that the code does not produce:\n" + "\n".join(wrong)
    assert len(vacuous) <= 2, f"quotes with no literal part of {MIN_CHECKED} characters to check: {vacuous}"


def test_the_check_fails_for_a_message_the_code_does_not_produce(source: str) -> None:
    """The check is real: a quote with one word changed, or an op the daemon does not have, is caught."""
    good = "daemon refused alloc: no room for a <n>-byte slot in the shared-memory budget after waiting <seconds> s"
    assert all(_covered(p, source) for p in _pieces(good))
    for bad in (good.replace("shared-memory budget", "shared-memory quota"), good.replace("no room", "not enough room")):
        assert not all(_covered(p, source) for p in _pieces(bad)), bad
    assert not all(_covered(p, source) for p in _pieces(good.replace("alloc", "allocate")))  # no such request


def test_every_entry_has_a_cause_and_a_fix() -> None:
    paragraphs = _paragraphs()
    heads = [p.split("**")[1].split(" ")[0].rstrip(":") for p in paragraphs if p.startswith("**") and p.count("**") >= 2]
    runs = [h for i, h in enumerate(heads) if h != "Message" or i == 0 or heads[i - 1] != "Message"]  # messages of one entry
    assert runs and runs == ["Message", "Cause", "Fix"] * (len(runs) // 3), f"entries not in **Message**, **Cause**, **Fix** order: {runs}"


def test_links_go_to_pages_that_exist() -> None:
    targets = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", PAGE.read_text())
    assert targets
    missing = sorted({t for t in targets if not (PAGE.parent / t).is_file()})
    assert not missing, f"links to pages that do not exist: {missing}"


def test_every_error_class_is_reachable_from_the_package_itself() -> None:
    """``except ckptd.UnsupportedState`` works as the page names it: every CheckpointError kind is exported by ``ckptd``."""
    import inspect

    import ckptd
    from ckptd import errors

    kinds = {n for n, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.CheckpointError)}
    assert kinds <= set(ckptd.__all__) and all(getattr(ckptd, n) is getattr(errors, n) for n in kinds)
