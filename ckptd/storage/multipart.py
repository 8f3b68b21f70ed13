"""The multipart uploads a daemon began and has not seen end, recorded in its root so that its next start aborts them.

A multipart upload that is neither completed nor aborted keeps its parts in the bucket, billed and invisible to
object listings, until someone aborts it. s3transfer aborts the uploads it gives up on; a daemon that is killed
(``systemctl kill``, the OOM killer, a node reboot) mid-upload leaves its uploads open, and the restarted daemon
uploads the same objects again under new upload ids. So:

* the daemon's :class:`~ckptd.storage.s3.S3Store` hands its boto3 client to :meth:`UploadLedger.watch` when it is
  made, which reads the records present (every one a dead daemon's: one daemon at a time holds a root) and hooks
  botocore's events;
* when S3 answers a ``CreateMultipartUpload``, the s3transfer worker thread that asked records the upload (one
  small JSON file under ``<root>/.ckptd-uploads/``, written durably);
* when a ``CompleteMultipartUpload`` or ``AbortMultipartUpload`` of it succeeds (or the upload is already gone),
  its record is removed;
* the uploads recorded before the start are aborted on the daemon's fetch thread after its start-up check of the
  bucket (``S3Store.abort_unfinished``, :meth:`UploadLedger.abort`).

Only uploads this root's daemon began are aborted: another node of a multi-node job uploading under the same prefix
keeps its own. Recording is best effort: a record that cannot be written (a full disk) is logged and the upload goes
on; a bucket lifecycle rule that aborts old incomplete uploads stays the backstop (docs/object-storage.md). A record that cannot be
read (cut short by a crash) is logged and removed. The root is the daemon's own (0700, writable by no one else), so
the records are trusted as far as their shape is checked.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import FormatError
from ..files import write_json_durable
from ..validate import read_regular

log = logging.getLogger("ckptd.daemon")

LEDGER_DIR = ".ckptd-uploads"  # in the daemon's root
FORMAT_VERSION = 1
MAX_RECORD = 16384  # bytes: a bucket name, a key of up to 1,024 bytes (JSON-escaped: up to 6x), an upload id, an endpoint
MAX_RECORDS = 100_000  # read at start-up at most: a root that holds more is not one this ledger wrote


@dataclass(frozen=True)
class Upload:
    """A multipart upload begun at ``endpoint`` (None: AWS) in ``bucket`` under ``key``."""

    bucket: str
    key: str
    upload_id: str
    endpoint: str | None


class UploadLedger:
    """The records under ``<root>/.ckptd-uploads/``: one file per open upload, named by a hash of its id. Safe to call
    from any thread (the s3transfer workers record and forget; the fetch thread reads and aborts)."""

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, LEDGER_DIR)
        self._made = threading.Lock()

    def _path(self, upload_id: str) -> str:
        return os.path.join(self.dir, xxhash.xxh3_128_hexdigest(upload_id.encode()) + ".json")

    def _ensure_dir(self) -> None:
        with self._made:
            try:
                os.mkdir(self.dir, 0o700)
            except FileExistsError:
                st = os.lstat(self.dir)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                    raise OSError(f"{self.dir} is not a directory of this user") from None

    def record(self, upload: Upload) -> None:
        """Record an upload S3 has just begun. Never raises: a failure is logged (the upload goes on unrecorded)."""
        try:
            self._ensure_dir()
            write_json_durable(
                self._path(upload.upload_id),
                {"format_version": FORMAT_VERSION, "bucket": upload.bucket, "key": upload.key, "upload_id": upload.upload_id,
                 "endpoint": upload.endpoint},
            )  # fmt: skip
        except (OSError, ValueError) as e:
            log.warning(
                "cannot record multipart upload of s3://%s/%s (a restart after a kill will not abort it): %s", upload.bucket, upload.key, e
            )

    def forget(self, upload_id: str) -> None:
        """The upload ended (completed or aborted, or it is gone): its record goes. Never raises."""
        try:
            os.unlink(self._path(upload_id))
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove the record of multipart upload %s: %s", upload_id, e)

    def pending(self) -> list[Upload]:
        """The uploads recorded and not forgotten. Call it only while no upload of this root can be under way (before
        the store that records begins one; one daemon per root): it removes temporaries of records being written. A
        record with the wrong shape, or that is no regular file, is logged and removed (it names nothing this daemon
        could abort); one that cannot be read now (``EIO``, ``EMFILE``) is logged and kept for the next start."""
        try:
            names = sorted(os.listdir(self.dir))[:MAX_RECORDS]
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("cannot list %s: %s", self.dir, e)
            return []
        out = []
        for name in names:
            path = os.path.join(self.dir, name)
            if not name.endswith(".json"):  # a temporary of a write cut short
                _remove(path)
                continue
            try:
                upload = _parse(read_regular(path, MAX_RECORD))
                if self._path(upload.upload_id) != path:
                    raise FormatError("its name is not its upload id's")
                out.append(upload)
            except FormatError as e:
                log.warning("removing the unreadable record %s of a multipart upload: %s", path, e)
                _remove(path)
            except OSError as e:
                log.warning("cannot read the record %s of a multipart upload (kept for the next start): %s", path, e)
        return out

    def watch(self, client: Any, endpoint: str | None) -> list[Upload]:
        """Record the multipart uploads ``client`` (a boto3 S3 client reaching ``endpoint``, None: AWS) begins from now
        on, and forget each once it ends; returns the uploads recorded before (a dead daemon's), for :meth:`abort`."""
        unfinished = self.pending()
        events = client.meta.events
        for op in ("CreateMultipartUpload", "CompleteMultipartUpload", "AbortMultipartUpload"):
            events.register(f"before-parameter-build.s3.{op}", _asked)
        events.register("after-call.s3.CreateMultipartUpload", functools.partial(self._began, endpoint))
        for op in ("CompleteMultipartUpload", "AbortMultipartUpload"):
            events.register(f"after-call.s3.{op}", self._ended)
        return unfinished

    def _began(self, endpoint: str | None, http_response: Any, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        """botocore's ``after-call`` of ``CreateMultipartUpload``, on the thread that asked: record the upload, under
        the bucket and key asked for (a server's answer may leave them out, or spell an access point otherwise)."""
        upload_id, (bucket, key, _id) = parsed.get("UploadId"), context.get(_CONTEXT_KEY, (None, None, None))
        if http_response.status_code < 300 and all(isinstance(v, str) and v for v in (upload_id, bucket, key)):
            self.record(Upload(bucket, key, upload_id, endpoint))

    def _ended(self, http_response: Any, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        """``after-call`` of a complete or an abort: the upload ended (or was gone already), so its record goes."""
        upload_id = context.get(_CONTEXT_KEY, (None, None, None))[2]
        error = parsed.get("Error") or {}
        if isinstance(upload_id, str) and ((http_response.status_code < 300 and not error) or error.get("Code") in _GONE):
            self.forget(upload_id)

    def abort(self, client: Any, uploads: list[Upload], bucket: str, endpoint: str | None, where: str) -> int:
        """Abort ``uploads`` through ``client`` (of ``bucket`` at ``endpoint``, named ``where`` in messages); returns how
        many were aborted. One already gone is forgotten; one that cannot be aborted now (the bucket unreachable) is
        logged and kept for the next start; one recorded for another bucket or endpoint (the configuration changed)
        is logged and forgotten. Never raises."""
        from .boto import boto_errors, error_code

        aborted = 0
        for up in uploads:
            what = f"s3://{up.bucket}/{up.key} (upload {up.upload_id})"
            if (up.bucket, up.endpoint) != (bucket, endpoint):
                log.warning("not aborting the unfinished multipart upload %s at %s: this daemon now uses bucket %r at %s",
                            what, up.endpoint or "AWS", bucket, where)  # fmt: skip
                self.forget(up.upload_id)
                continue
            try:
                client.abort_multipart_upload(Bucket=up.bucket, Key=up.key, UploadId=up.upload_id)
            except boto_errors() as exc:
                if error_code(exc) in _GONE:  # it ended before its record went
                    self.forget(up.upload_id)
                else:
                    log.warning("cannot abort the unfinished multipart upload %s (tried again at the next start): %s", what, exc)
                continue
            aborted += 1
            log.info("aborted the multipart upload %s that a previous daemon left unfinished", what)
        return aborted


_CONTEXT_KEY = "ckptd_multipart"
_GONE = ("NoSuchUpload", "404")  # an abort's answer for an upload that ended: with S3's error body, or without one


def _asked(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    """botocore's ``before-parameter-build`` of a create, a complete or an abort: note in the request's context the
    bucket, key and upload it names (its ``after-call`` sees the context, not the parameters)."""
    context[_CONTEXT_KEY] = (params.get("Bucket"), params.get("Key"), params.get("UploadId"))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _parse(data: bytes) -> Upload:
    try:
        rec = json.loads(data)
    except ValueError as e:
        raise FormatError(f"not JSON: {e}") from None
    if not isinstance(rec, dict) or rec.get("format_version") != FORMAT_VERSION:
        raise FormatError(f"not a record of format_version {FORMAT_VERSION}")
    fields = [rec.get(k) for k in ("bucket", "key", "upload_id")]
    endpoint = rec.get("endpoint")
    if not all(isinstance(f, str) and f for f in fields) or not (endpoint is None or isinstance(endpoint, str)):
        raise FormatError("bucket, key and upload_id must be non-empty strings, endpoint a string or null")
    return Upload(*fields, endpoint)
