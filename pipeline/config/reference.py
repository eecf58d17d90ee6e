"""``drafter config --keys``: every config key with its type, built-in default and meaning, read from the dataclasses'
own fields and docstrings (so the reference cannot drift from the config it describes)."""

from __future__ import annotations

from dataclasses import fields

from pipeline.config.schema import INPUT_OVERRIDE, describe, excluded_fields
from pipeline.config.sections import PipelineConfig
from pipeline.config.stage_names import STAGE_NAMES
from pipeline.errors import DrafterError

STAGE_SECTIONS = ("workdir", "target", "mlflow")
"""The sections every stage reads, listed with a stage's own keys."""


def config_reference(section: str | None = None) -> str:
    """The config reference: every key (or those under ``section``) with type, built-in default, meaning.

    ``section`` is a dotted key prefix (``count``, ``train_drafter.train``, ``mlflow``); a stage's section
    comes with the shared ones every stage reads (``workdir``, ``target``, ``mlflow``). Keys that never
    enter an artifact id are marked ``[run setting]``, upstream artifact paths ``[input: …]``.
    """
    every = describe(PipelineConfig)

    def under(prefix: str) -> list[tuple[str, str, str, str]]:
        return [r for r in every if r[0] == prefix or r[0].startswith(prefix + ".")]

    groups = {"": every}
    if section:
        groups = {"": under(section)}
        if not groups[""]:
            top = [f.name for f in fields(PipelineConfig)]
            raise DrafterError(f"No config key or section {section!r}.", expected=f"one of: {', '.join(top)}",
                               found=repr(section), fix="Run `drafter config --keys` to see every key.")
        if section in STAGE_NAMES:
            groups["shared by every stage:"] = [r for shared in STAGE_SECTIONS for r in under(shared)]
    marks = {key: "  [input: its artifact id enters the id]" if why == INPUT_OVERRIDE else "  [run setting]"
             for key, why in excluded_fields(PipelineConfig).items()}
    width = max(len(r[0]) for rows in groups.values() for r in rows)
    lines = ["config keys (set in the YAML or override as key=value; [run setting]: not part of any artifact id;",
             "[input]: a path to an upstream artifact used instead of the stage's own):"]
    for title, rows in groups.items():
        lines += [title] if title else []
        for key, tp, default, doc in rows:
            lines.append(f"  {key:<{width}}  {tp} = {default}{marks.get(key, '')}")
            if doc:
                lines.append(f"  {'':<{width}}    {doc}")
    return "\n".join(lines)
