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
USERINFO = re.compile(r"(?<!/)//(?!/)\S*@")
"""A URL's ``//user:password@``: from the ``//`` of an authority up to the last ``@`` before white space. A password
may hold ``@``, ``/``, ``?`` or ``#`` unencoded (where urllib would end the authority and show the rest as a path), so
this hides too much rather than too little (an ``@`` later in a path); ``sqlite:////a@b`` has no authority."""
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
