"""What boto3's failures look like, for the bucket store and its multipart ledger (imported on first use: botocore
is only loaded where a bucket is configured)."""

from __future__ import annotations

import functools


@functools.cache
def boto_errors() -> tuple[type[BaseException], ...]:
    """Every exception class that means "the request failed" in boto3, botocore and s3transfer."""
    import boto3.exceptions
    import botocore.exceptions
    import s3transfer.exceptions

    return (
        botocore.exceptions.BotoCoreError,
        botocore.exceptions.ClientError,
        boto3.exceptions.Boto3Error,
        s3transfer.exceptions.RetriesExceededError,
        s3transfer.exceptions.S3UploadFailedError,
        s3transfer.exceptions.S3DownloadFailedError,
        s3transfer.exceptions.FatalError,
    )


def error_code(exc: BaseException) -> str:
    """The S3 error code of a failed request (``NoSuchKey``, ``412``, ...), or ``""``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""
