"""The one exception type a user can cause, and how its message is built.

Every error that bad input can trigger (a wrong config key, a missing file, a corrupt artifact, a
mismatched tokenizer, an unreachable MLflow server) is raised as :class:`DrafterError` with a message
that says what was expected, what was found, and what to do. The CLI prints it without a traceback.
"""

from __future__ import annotations

import os
import re
import urllib.parse

CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
"""Environment variables whose values are secrets: never printed, logged or put in an error."""
USERINFO = re.compile(r"(?<!/)//(?!/)(?:\S*@|[^\s/?#@]*(?:[^\S\r\n]+[^\s@]+){0,15}[^\S\r\n]+\S*@)")
"""A URL's ``//user:password@``: from the ``//`` of an authority up to its last ``@``. A password may hold ``@``, ``/``,
``?`` or ``#`` unencoded (where urllib would end the authority and show the rest as a path), so this hides too much
rather than too little (an ``@`` later in a path); ``sqlite:////a@b`` has no authority. White space ends a URL quoted
in a message, unless the first word after ``//`` holds none of ``@/?#``: then the user info holds a password with
spaces (``//alice:hunter 2@host``) and runs to the last ``@`` of the next word on the line that holds one, within 16
words (so a long line of many URLs is still read in linear time)."""
_SHORTEST_SECRET = 4  # a shorter value would hide ordinary words; no real password or token is that short


def _secrets(uris: tuple[str | None, ...]) -> list[str]:
    values = [os.environ.get(name) for name in CREDENTIAL_VARIABLES]
    for uri in (*uris, os.environ.get("MLFLOW_TRACKING_URI")):
        try:
            parts = urllib.parse.urlsplit(uri or "")
            values += [parts.username, parts.password]
        except ValueError:  # a malformed URI: the user info below is all there is
            pass
        values += list(userinfo(uri or "") or ())  # the whole password where urllib cuts it at a "/", "?" or "#"
    values += [urllib.parse.unquote(v) for v in values if v and "%" in v]
    return sorted({v for v in values if v and len(v) >= _SHORTEST_SECRET}, key=len, reverse=True)


def userinfo(uri: str) -> tuple[str, str] | None:
    """``(user, password)`` of a URI's user info (:data:`USERINFO`; password ``""`` for a bare token), else None."""
    found = USERINFO.search(uri)
    if found is None:
        return None
    user, _, password = found[0][2:-1].partition(":")
    return user, password


def credentials_in_uri(origin: str, why: str) -> DrafterError:
    """The error for a tracking URI with user info in it (``origin``: where it came from; ``why``: where it would
    show)."""
    return DrafterError(
        f"{origin} holds credentials (user info before the host). {why}, so credentials come from "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN only.",
        expected="a tracking URI without user info, e.g. https://mlflow.example.com",
        found="user info in the URI (not shown)",
        fix="Remove user:password@ from the URI and export MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) instead. (An @ in the URI's path: write it as %40.)")


SERVER_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?!/)")
"""A URI with an authority (``https://host…``; ``sqlite:///path`` and ``file:///path`` have none)."""


def refuse_secrets_in_uri(uri: str, origin: str, why: str) -> None:
    """Refuse a tracking URI holding user info (:func:`credentials_in_uri`), or white space after a ``scheme://``
    (no URL holds any, and one there may be a password's), without showing it (``origin``: where it came from;
    ``why``: where it would show). A local store's path may hold a space."""
    if userinfo(uri):
        raise credentials_in_uri(origin, why)
    if SERVER_URI.match(uri) and (space := re.search(r"\s", uri)):
        raise DrafterError(
            f"{origin} holds white space, which a server URI never does (it is not shown: the space may be part "
            "of a password).",
            expected="a tracking URI without white space, e.g. https://mlflow.example.com (in a path, write a space "
                     "as %20)",
            found=f"{space[0]!r} at character {space.start() + 1} of {len(uri)} (the URI is not shown)",
            fix="Remove the white space. Credentials come from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / "
                "MLFLOW_TRACKING_TOKEN only, never from the URI.")


def redact(uri: str) -> str:
    """Hide a password or token embedded in a URI before it is printed or logged."""
    return USERINFO.sub("//***@", uri)


def scrub(text: str, *uris: str | None) -> str:
    """``text`` with every credential it could carry replaced by ``***``: a URL's user and password (``//user:pw@``),
    the user and password of ``uris`` and of ``$MLFLOW_TRACKING_URI`` wherever they appear (an error may quote them
    cut out of their URL), and the values of :data:`CREDENTIAL_VARIABLES`."""
    for secret in _secrets(uris):  # first: a password cut short by the pattern below would no longer be found whole
        text = text.replace(secret, "***")
    return USERINFO.sub("//***@", text)


class DrafterError(Exception):
    """An error the user can fix. ``str(err)`` is a complete, actionable message."""

    def __init__(self, problem: str, *, expected: str | None = None, found: str | None = None,
                 fix: str | None = None) -> None:
        # an error quotes paths, URIs and other tools' messages: none of it may carry a credential
        problem, expected, found, fix = (None if part is None else scrub(part) for part in (problem, expected, found, fix))
        self.problem = problem
        self.expected = expected
        self.found = found
        self.fix = fix
        lines = [problem]
        if expected is not None:
            lines.append(f"  expected: {expected}")
        if found is not None:
            lines.append(f"  found:    {found}")
        if fix is not None:
            lines.append(f"  what to do: {fix}")
        super().__init__("\n".join(lines))
