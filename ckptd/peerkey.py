"""The key that peer links between node daemons are authenticated and encrypted with (CurveZMQ).

One key pair per cluster, made once with ``ckptd keygen FILE`` and given to every node's daemon
(``--peer-key FILE``): each daemon serves its peer port with the pair's secret key and admits only a
client that proves it holds the same secret (the ZAP check in :mod:`ckptd.daemon.replicas`); each
connects to its peers with it. Whoever holds the file is a member of the cluster; whoever does not
is refused in the handshake, before a byte of theirs is read.

The file is a small JSON object, ``{"kind": "ckptd-peer-key", "version": 1, "public": Z85, "secret":
Z85}`` (the keys in ZeroMQ's Z85 text, 40 characters each), mode 0600 and owned by the user that
reads it: a key file others may read is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from .errors import CheckpointError

KIND = "ckptd-peer-key"
VERSION = 1
MAX_KEY_FILE_BYTES = 4096
Z85_KEY_CHARS = 40


class KeyFileError(CheckpointError):
    """A peer key file that cannot be used: missing, readable by others, not a key, or damaged."""


@dataclass(frozen=True)
class PeerKey:
    """A CurveZMQ key pair, Z85-encoded (bytes, as pyzmq's socket options take them)."""

    public: bytes
    secret: bytes
    path: str

    def __repr__(self) -> str:  # never print the secret
        return f"PeerKey(public={self.public.decode()!r}, path={self.path!r})"


def keygen(path: str) -> PeerKey:
    """Make a new key pair and write it to ``path`` (mode 0600; an existing file is never replaced)."""
    import zmq

    if not zmq.has("curve"):
        raise KeyFileError("this pyzmq's libzmq was built without CurveZMQ: peer links cannot be encrypted")
    public, secret = zmq.curve_keypair()
    body = json.dumps({"kind": KIND, "version": VERSION, "public": public.decode(), "secret": secret.decode()}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{path} exists: a key is never overwritten (every node holding the old one would be shut out)") from None
    except OSError as e:
        raise KeyFileError(f"cannot create the key file {path}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, body.encode())
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise KeyFileError(f"cannot write the key file {path}: {e.strerror}") from None
    os.close(fd)
    return PeerKey(public, secret, path)


def load_key(path: str) -> PeerKey:
    """Read the key pair at ``path``. Raises :class:`KeyFileError` for a file that is not a regular file owned by
    this user with no access for group or others (0600 or stricter), or that holds no valid key pair."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise KeyFileError(f"cannot open the peer key file {path}: {e.strerror} (make one with: ckptd keygen {path})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"the peer key file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise KeyFileError(f"the peer key file {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
        if st.st_mode & 0o077:
            raise KeyFileError(
                f"the peer key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: others may read the cluster's secret;"
                f" it must be 0600 (chmod 600 {path})"
            )
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    return _parse(raw, path)


def _parse(raw: bytes, path: str) -> PeerKey:
    import zmq

    if len(raw) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path} is larger than a peer key file ({MAX_KEY_FILE_BYTES} bytes at most)")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise KeyFileError(f"{path} is not a ckptd peer key file (not JSON)") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("version") != VERSION:
        raise KeyFileError(f"{path} is not a ckptd peer key file (made by ckptd keygen, kind {KIND!r}, version {VERSION})")
    keys = [doc.get("public"), doc.get("secret")]
    if not all(isinstance(k, str) and len(k) == Z85_KEY_CHARS and k.isascii() for k in keys):
        raise KeyFileError(f"{path}: public and secret must be {Z85_KEY_CHARS}-character Z85 keys")
    public, secret = (k.encode() for k in keys)  # type: ignore[union-attr]
    try:
        matches = zmq.curve_public(secret) == public
    except (zmq.ZMQError, ValueError):
        matches = False
    if not matches:
        raise KeyFileError(f"{path}: the public key is not the secret key's: the file is damaged")
    return PeerKey(public, secret, path)
