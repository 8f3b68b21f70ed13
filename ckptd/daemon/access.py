"""Who may use what the daemon creates: its owner only, or also one configured group.

Owner-only (the default): the checkpoint root 0700, the socket's directory 0700, the socket and every
segment 0600. With ``--group G``: root 2750 (setgid, so every step below inherits the group and G's
members can restore), socket directory 0750, socket and segments 0660 with group G.
Called by the daemon's main thread at start-up (root, socket) and when it creates a segment.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from ..errors import CheckpointError

log = logging.getLogger("ckptd.daemon")


def resolve_group(group: str | int | None) -> int | None:
    """The gid of a group given by name or number; ``None`` for none. Raises ``CheckpointError``."""
    if group is None or group == "":
        return None
    import grp

    try:
        if isinstance(group, int) or group.isdigit():
            return grp.getgrgid(int(group)).gr_gid
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise CheckpointError(f"unknown group {group!r}") from None


class Access:
    """The file modes and group of everything the daemon creates."""

    def __init__(self, group: str | int | None = None) -> None:
        self.gid = resolve_group(group)
        self.file_mode = 0o600 if self.gid is None else 0o660  # socket, segments
        self.dir_mode = 0o700 if self.gid is None else 0o750  # the socket's directory
        self.root_mode = 0o700 if self.gid is None else 0o2750

    def restrict(self, path: str, mode: int) -> None:
        os.chmod(path, mode)
        if self.gid is not None:
            os.chown(path, -1, self.gid)

    def make_root(self, root: str) -> None:
        """Create the checkpoint root with the right mode; warn if an existing one is open to everyone."""
        if not os.path.isdir(root):
            os.makedirs(root)
            self.restrict(root, self.root_mode)
        elif (mode := os.stat(root).st_mode) & 0o007:
            log.warning("checkpoint root %s is accessible to every user on this node (mode %o)", root, mode & 0o7777)

    def make_socket_dir(self, path: str) -> None:
        d = os.path.dirname(path)
        if d and not os.path.isdir(d):
            os.makedirs(d)
            self.restrict(d, self.dir_mode)

    @contextlib.contextmanager
    def file_umask(self) -> Iterator[None]:
        """Files created inside get at most ``file_mode`` from birth (a socket file cannot be made
        with a mode of its own: restricting it after bind would leave a race)."""
        old = os.umask(0o777 & ~self.file_mode)
        try:
            yield
        finally:
            os.umask(old)
