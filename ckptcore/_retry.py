"""Which store failures are worth another try: the one judgement behind every retry.

A replication that fails on the store is tried again later only when trying again can help:
the store or the network failing for now (an outage, a reset connection, throttling, a server
error) or another writer's lock.  A missing bucket, missing or refused credentials, a
permission, a damaged source or a bug are reported at once.  Codes are read as S3, GCS and
Azure spell them, from the error and every error it was raised from.
"""

from __future__ import annotations

import errno

from ._storage import bucket_missing, error_chain
from .errors import CheckpointError, FencedError, LockedError, StorageError

# Store answers worth another try (throttling, a server's own failure) and those that are not
# (credentials, permissions, a missing bucket), as S3, GCS and Azure spell them.
_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                              "Throttling", "ThrottlingException", "TooManyRequests",
                              "RequestLimitExceeded", "ServerBusy", "OperationTimedOut",
                              "500", "502", "503", "504"})
_PERMANENT_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                              "NoSuchBucket", "AllAccessDisabled", "InvalidBucketName",
                              "AccountProblem", "AuthenticationFailed", "AuthorizationFailure",
                              "ContainerNotFound", "403", "404"})
_PERMANENT_CLASSES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                                "CredentialRetrievalError", "ClientAuthenticationError",
                                "DefaultCredentialsError", "RefreshError"})
# errno values of a network or a server failing for now (s3fs maps SlowDown and
# ServiceUnavailable to EBUSY, InternalError to EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "EBUSY", "EAGAIN", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE",
    "EREMOTEIO", "ENETUNREACH", "EHOSTUNREACH", "ENETDOWN") if hasattr(errno, n))


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str((response.get("Error") or {}).get("Code", ""))
    return str(getattr(e, "error_code", "") or getattr(e, "code", "") or "")


def transient(e: BaseException) -> bool:
    """Whether a failed replication may succeed if tried again: the store or the network failing
    for now (an outage, a reset connection, throttling, a server error) or another writer's
    lock; not a missing bucket, missing or refused credentials, a permission, a damaged source
    or a bug."""
    chain = error_chain(e)
    if any(type(x).__name__ in _PERMANENT_CLASSES or _code(x) in _PERMANENT_CODES
           or isinstance(x, PermissionError) for x in chain) or bucket_missing(e):
        return False
    if isinstance(e, FencedError):
        return False  # another writer took this root over: for good
    if isinstance(e, LockedError):
        return True
    if isinstance(e, CheckpointError) and not isinstance(e, StorageError):
        return False  # damaged or incomplete source, schema, usage
    if any(_code(x) in _TRANSIENT_CODES for x in chain):
        return True
    if isinstance(e, StorageError):
        return True  # the store failing: what ckptcore's storage layer wraps is network trouble
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS
