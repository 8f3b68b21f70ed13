"""The multi-node tier's settings (``[remote]`` in the daemon's config): a bucket (:class:`RemoteConfig`) or a
shared directory (:class:`DirConfig`), validated on construction, and the rule for a safe relative key; apart from
:mod:`.storage.s3`, the client, so that reading a config never needs boto3."""

from __future__ import annotations

import dataclasses
import posixpath
import re
from dataclasses import dataclass
from typing import Any

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4_RE = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_MIN_PART = 5 << 20  # S3's smallest multipart chunk (all but the last part)
_MAX_PART = 5 << 30  # S3's largest single part

# field -> accepted types; bool is refused separately (it is an int subclass)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "bucket": (str,),
    "prefix": (str,),
    "endpoint_url": (str, type(None)),
    "region": (str, type(None)),
    "max_bandwidth": (int, type(None)),
    "part_size": (int,),
    "max_attempts": (int,),
    "connect_timeout": (int, float),
    "read_timeout": (int, float),
}


def check_rel(what: str, rel: object, *, prefix_of_keys: bool = False) -> str:
    """Return ``rel`` if it is a safe relative key (or key prefix), else raise ``ValueError``.

    Refused: a leading ``/``, ``.`` or ``..`` segments, empty segments (``a//b``). A key prefix
    (``prefix_of_keys``) may be empty and may end with ``/``; a key may do neither.
    """
    if not isinstance(rel, str):
        raise ValueError(f"{what} must be a string, got {type(rel).__name__}")
    if rel == "" and prefix_of_keys:
        return rel
    if rel.startswith("/"):
        raise ValueError(f"{what} {rel!r} must not start with '/'")
    segments = rel.split("/")
    if prefix_of_keys and segments[-1] == "":
        segments.pop()
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"{what} {rel!r} must not contain empty, '.' or '..' path segments")
    return rel


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how to reach the bucket. Validated on construction; ``prefix`` loses trailing ``/``.

    ``max_attempts`` counts every attempt of one request, the first included (1 = no retry).
    ``part_size`` is both the multipart threshold and the chunk size: files of ``part_size`` bytes
    or more are uploaded in parts of that size (S3 allows 5 MiB to 5 GiB).
    ``max_bandwidth`` (bytes/s) caps uploads and downloads of the whole store together.
    Credentials are not part of the config: boto3's usual chain supplies them (``AWS_*``
    environment variables, ``~/.aws``, an instance role).
    """

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str | None = None
    max_bandwidth: int | None = None
    part_size: int = 64 << 20
    max_attempts: int = 8
    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    def __post_init__(self) -> None:
        for name, types in _FIELD_TYPES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, types):
                want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
                raise ValueError(f"remote config: {name} must be {want}, got {type(value).__name__} {value!r}")
        b = self.bucket
        if not _BUCKET_RE.match(b) or ".." in b or _IPV4_RE.match(b):
            raise ValueError(
                f"remote config: invalid bucket name {b!r}: use 3-63 lowercase letters, digits, '.' and '-', "
                "starting and ending with a letter or digit, no '..', not an IP address"
            )
        if self.prefix.startswith("/"):
            raise ValueError(f"remote config: prefix {self.prefix!r} must not start with '/'")
        prefix = self.prefix.rstrip("/")
        if prefix:
            check_rel("remote config: prefix", prefix)
        object.__setattr__(self, "prefix", prefix)
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ValueError(f"remote config: endpoint_url {self.endpoint_url!r} must start with http:// or https://")
        if self.max_bandwidth is not None and self.max_bandwidth <= 0:
            raise ValueError(f"remote config: max_bandwidth must be positive bytes/s, got {self.max_bandwidth}")
        if not _MIN_PART <= self.part_size <= _MAX_PART:
            raise ValueError(f"remote config: part_size must be between {_MIN_PART} and {_MAX_PART} bytes, got {self.part_size}")
        if self.max_attempts < 1:
            raise ValueError(f"remote config: max_attempts must be at least 1, got {self.max_attempts}")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"remote config: {name} must be positive seconds, got {value}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteConfig:
        """Build from a parsed TOML/JSON table; unknown keys, wrong types and bad values raise ``ValueError``."""
        if not isinstance(d, dict):
            raise ValueError(f"remote config must be a table, got {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"remote config: unknown keys {', '.join(map(repr, unknown))}")
        if "bucket" not in d:
            raise ValueError("remote config: 'bucket' is required")
        return cls(**d)


@dataclass(frozen=True)
class DirConfig:
    """A shared directory every node of a job mounts (``[remote] path = "/lustre/ckpts"``, ``--remote-path``): the
    multi-node tier instead of a bucket (:class:`ckptd.storage.posix.DirStore`). ``path``: absolute, normalized."""

    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"remote config: path must be a non-empty string, got {self.path!r}")
        if not self.path.startswith("/"):
            raise ValueError(f"remote config: path {self.path!r} must be absolute (every node mounts it at the same place)")
        if "\0" in self.path or "\n" in self.path:
            raise ValueError("remote config: path must not contain NUL or newline characters")
        object.__setattr__(self, "path", posixpath.normpath(self.path))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DirConfig:
        """Build from a parsed ``[remote]`` table that names ``path``; a bucket's keys beside it raise ``ValueError``."""
        unknown = sorted(set(d) - {"path"})
        if unknown:
            raise ValueError(
                f"remote config: {', '.join(map(repr, unknown))} do not go with 'path': [remote] names a bucket or a shared"
                " directory, not both"
            )
        return cls(d["path"])
