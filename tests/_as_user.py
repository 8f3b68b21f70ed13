"""Act as another local user from a test, wherever the checkout lives.

A clone in a directory only its owner can enter (root's 0700 home, ``mktemp -d``) holds the virtual
environment too, so a Python started as ``nobody`` (``setpriv ... python``) cannot read its site-packages
(``No module named 'zmq'``), nor, with an interpreter under ``/root/.pyenv``, its own standard library. A
helper here starts as root instead, imports what it needs, and only then gives root up for good
(``setgroups``, ``setgid``, ``setuid``, in that order): all it does afterwards, it does as the other user,
which is what the tests need (who binds a socket, creates a file, opens a segment, connects).
"""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Sequence

import pytest

try:
    NOBODY: pwd.struct_passwd | None = pwd.getpwnam("nobody")
except KeyError:
    NOBODY = None

CAN_ACT_AS_NOBODY = os.geteuid() == 0 and NOBODY is not None
needs_nobody = pytest.mark.skipif(not CAN_ACT_AS_NOBODY, reason="needs root and a 'nobody' user to act as another user")


def python_as(
    code: str,
    *args: str,
    uid: int,
    gid: int,
    groups: Sequence[int] = (),
    imports: Sequence[str] = (),
    executable: str = sys.executable,
) -> list[str]:
    """The argv of a Python that imports ``imports`` as root, then runs ``code`` as ``uid``/``gid``.

    Args:
        code: the program; ``sys.argv[1:]`` are ``args`` as usual for ``python -c``.
        uid: the user it becomes (real, effective and saved: it cannot become root again).
        gid: its group.
        groups: its supplementary groups (none by default).
        imports: modules to import while still root (``os`` and ``sys`` always are); ``code`` may import
            them again, which then only looks them up.
        executable: the interpreter (the suite's own by default).

    Returns:
        The command line, for ``subprocess``.
    """
    prelude = "import os, sys\n" + "".join(f"import {m}\n" for m in imports)
    prelude += f"os.setgroups({list(groups)!r}); os.setgid({gid}); os.setuid({uid})\n"
    prelude += f"assert (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) == ({uid}, {uid}, {gid}, {gid})\n"
    return [executable, "-c", prelude + code, *args]


def python_as_nobody(code: str, *args: str, imports: Sequence[str] = (), executable: str = sys.executable) -> list[str]:
    """:func:`python_as` for user ``nobody`` in its own group, with no supplementary groups."""
    assert NOBODY is not None
    return python_as(code, *args, uid=NOBODY.pw_uid, gid=NOBODY.pw_gid, imports=imports, executable=executable)
