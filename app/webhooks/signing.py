"""The webhook signature: HMAC-SHA256 over ``timestamp + "." + body``, hex in a header.

Signing the timestamp with the body lets a receiver refuse a replayed delivery: it
checks the signature, then that the timestamp is recent (docs/api.md, "Webhooks", has a
receiver's check to copy).
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-Maec-Signature"
TIMESTAMP_HEADER = "X-Maec-Timestamp"
PREFIX = "sha256="
# How old a delivery :func:`verify` accepts by default (receivers choose their own).
DEFAULT_TOLERANCE_S = 300


def _key(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def sign(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256(secret, f"{timestamp}." + body)."""
    mac = hmac.new(_key(secret), f"{timestamp}.".encode() + body, hashlib.sha256)
    return PREFIX + mac.hexdigest()


def signed_headers(secret: str | bytes, body: bytes, now: float | None = None
                   ) -> dict[str, str]:
    timestamp = int(time.time() if now is None else now)
    return {TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: sign(secret, timestamp, body)}


def verify(secret: str | bytes, body: bytes, timestamp: str, signature: str, *,
           tolerance_s: float = DEFAULT_TOLERANCE_S, now: float | None = None) -> bool:
    """True when ``signature`` signs ``body`` at ``timestamp`` and that is within
    ``tolerance_s`` of ``now`` (compared in constant time)."""
    if not timestamp.isdigit():
        return False
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)
