"""Credentials written into a URL's authority (`s3://user:password@host/...`): found, and hidden.

fsspec takes a user name and password from an object store URL as readily as from
`storage_options`. Secrets in `storage_options` are found by their names
(`config.is_secret_option`); these have none, so they are found by the URL's structure.
The object tier scrubs them from every error, log line and `kvstrata status`
(`url_credentials`), the node store's start-up line shows `redact_url`, and
`actors/secrets.py` keeps the user info out of the store actor's arguments.

Invariants: functions only, no I/O; a URL without user info is returned unchanged.
This module imports nothing of kvstrata, Ray or vLLM (tiers, actors and the CLI use it).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

MIN_SCRUBBED_NAME = 4  # shorter user names are left in free text ("s3" would mangle every message)


def url_userinfo(url: str) -> str | None:
    """The `user[:password]` part of a URL's authority, as written; None if it has none."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        return None
    userinfo, at, _ = netloc.rpartition("@")
    return userinfo if at and userinfo else None


def url_credentials(url: str) -> list[str]:
    """Texts to scrub from anything that may quote the URL: its password as written and as
    decoded, and its user name (an access key id, often) where it is long enough to be one."""
    userinfo = url_userinfo(url)
    if userinfo is None:
        return []
    user, colon, password = userinfo.partition(":")
    found = [userinfo]
    if colon and password:
        found += [password, unquote(password)]
    if len(user) >= MIN_SCRUBBED_NAME:
        found += [user, unquote(user)]
    return sorted(set(found), key=len, reverse=True)


def redact_url(url: str) -> str:
    """The URL with its user info replaced by `***` (`s3://***@host/path`)."""
    userinfo = url_userinfo(url)
    return url if userinfo is None else url.replace(f"{userinfo}@", "***@", 1)
