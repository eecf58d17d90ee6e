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
USERINFO = re.compile(r"//[^/\s]*@")
"""A URL's ``//user:password@``, up to the netloc's last ``@`` (as urllib splits it: a password may hold an ``@``)."""
_SHORTEST_SECRET = 4  # a shorter value would hide ordinary words; no real password or token is that short


def _secrets(uris: tuple[str | None, ...]) -> list[str]:
    values = [os.environ.get(name) for name in CREDENTIAL_VARIABLES]
    for uri in (*uris, os.environ.get("MLFLOW_TRACKING_URI")):
        try:
            parts = urllib.parse.urlsplit(uri or "")
            userinfo = [parts.username, parts.password]
        except ValueError:  # a malformed URI: take what stands between the scheme and the last "@" of its netloc
            netloc = (uri or "").split("//", 1)[-1].split("/", 1)[0]
            userinfo = netloc.rpartition("@")[0].split(":", 1) if "@" in netloc else []
        values += [part for part in userinfo if part]
    values += [urllib.parse.unquote(v) for v in values if v and "%" in v]
    return sorted({v for v in values if v and len(v) >= _SHORTEST_SECRET}, key=len, reverse=True)


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
