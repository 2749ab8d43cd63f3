"""The Redis password every service uses, from a file (a mounted Secret), never a flag value.

Where the password comes from, first found wins: the URL's own credentials
(`redis://:PASSWORD@host:6379/0`, or `redis://USER:PASSWORD@...` for an ACL user), then
`--redis-password-file` ($REDIS_PASSWORD_FILE), then $REDIS_PASSWORD (a secretKeyRef). TLS is
the URL's scheme: `rediss://host:6380/0?ssl_ca_certs=/path/ca.crt` verifies the server against
that CA (redis-py reads the query options).

One setting per process, like the TLS files (services/common/channels.py): `main` calls
`use_redis_password_file` once after parsing its flags, before any client connects.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

_password_from_file: str | None = None


def add_redis_password_flag(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--redis-password-file",
        default=os.environ.get("REDIS_PASSWORD_FILE") or None,
        metavar="PATH",
        help="Redis AUTH password, read from this file (default: $REDIS_PASSWORD_FILE, else "
        "$REDIS_PASSWORD, else the URL's credentials or none)",
    )


def use_redis_password_file(path: str | None) -> None:
    """Reads the password now (ValueError naming the flag if it cannot be read or is empty)."""
    global _password_from_file
    if path is None:
        _password_from_file = None
        return
    try:
        password = Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"--redis-password-file: {error}") from None
    if not password:
        raise ValueError(f"--redis-password-file: {path} is empty")
    _password_from_file = password


def redis_password() -> str | None:
    """The password to give redis-py beside a URL (whose own credentials still win)."""
    return _password_from_file or os.environ.get("REDIS_PASSWORD") or None
