"""The one exception type a user can cause, and how its message is built.

Every error that bad input can trigger (a wrong config key, a missing file, a corrupt artifact, a
mismatched tokenizer, an unreachable MLflow server) is raised as :class:`DrafterError` with a message
that says what was expected, what was found, and what to do. The CLI prints it without a traceback.
"""

from __future__ import annotations


class DrafterError(Exception):
    """An error the user can fix. ``str(err)`` is a complete, actionable message."""

    def __init__(self, problem: str, *, expected: str | None = None, found: str | None = None,
                 fix: str | None = None) -> None:
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
