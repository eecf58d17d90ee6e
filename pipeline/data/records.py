"""ShareGPT-style records made into :class:`Conversation` objects: one record's roles and turns normalised (the role
spellings of several dumps mapped, empty and non-Unicode turns dropped and counted, leading assistant turns
trimmed), a JSON array parsed record by record so a truncated dump keeps every complete record, JSON Lines, and the
immutable form the loaders cache. :mod:`pipeline.data.sources` reads the sources; this module owns the records.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import DrafterError

# ShareGPT dumps use several spellings for the same three roles; anything else is dropped and counted.
ROLE_MAP = {
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "chatgpt", "bing", "bard", "assistant", "model"), "assistant"),
    "system": "system",
}

_SEPARATORS = re.compile(r"[\s,]*")


@dataclass
class Conversation:
    """One conversation: an id and its messages in order.

    Attributes:
        id: Stable identifier (the source's own id where it has one); :func:`split_heldout` hashes it.
        messages: ``{"role": "system"|"user"|"assistant", "content": str}`` dicts, non-empty contents.
        group: Split key for :func:`split_heldout` when several records are parts of one original
            conversation (the packaged ShareGPT splits long chats into ``<base>_0``, ``<base>_1`` …);
            empty means the id itself.
    """

    id: str
    messages: list[dict[str, str]]
    group: str = ""

    @property
    def split_key(self) -> str:
        """What the held-out splits hash: the chat's group, else the record's own id."""
        return self.group or self.id


@dataclass
class SourceReport:
    """What loading a source did: counts and the reasons records were dropped."""

    source: str
    records_read: int
    records_kept: int
    records_dropped: int
    notes: list[str] = field(default_factory=list)


# A normalised conversation as cached: immutable, so callers always get fresh mutable copies.
Frozen = tuple[str, tuple[tuple[str, str], ...]]


def normalise_record(record: Any, counters: Counter[str]) -> Frozen | None:
    """Map one raw record to ``(id, ((role, content), ...))``, or None when it has nothing usable; the id is ``""``
    for a record without one (:func:`normalise_all` names it by its content)."""
    if not isinstance(record, dict):
        counters["records that are not JSON objects"] += 1
        return None
    # JSON may escape a lone surrogate (\ud800), which no UTF-8 tokenizer, Arrow column or hash can take: an
    # id keeps it as the visible escape (still unique), a turn holding one is dropped and counted.
    own = next((record[key] for key in ("id", "task_id") if record.get(key) not in (None, "")), None)
    rec_id = "" if own is None else printable(str(own))  # an empty or null id is no id
    turns: list[tuple[str, str]] = []
    if isinstance(record.get("conversations"), list):
        raw = [(t.get("from"), t.get("value")) for t in record["conversations"] if isinstance(t, dict)]
    elif isinstance(record.get("messages"), list):
        raw = [(t.get("role"), t.get("content")) for t in record["messages"] if isinstance(t, dict)]
    elif isinstance(record.get("prompt", record.get("text")), str):
        raw = [("user", record.get("prompt", record.get("text")))]
    else:
        counters["records without conversations/messages/prompt/text"] += 1
        return None
    if any(isinstance(content, list) and joined_text(content) is None for _, content in raw):
        counters["records with non-text content parts (image, audio, file …)"] += 1
        return None
    for role, content in raw:
        mapped = ROLE_MAP.get(str(role).lower()) if role is not None else None
        if mapped is None:
            counters["turns with an unknown role"] += 1
            continue
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}, ...]
            content = joined_text(content)
        if not isinstance(content, str) or not content.strip():
            counters["empty turns"] += 1
            continue
        if printable(content) != content:
            counters["turns holding a lone surrogate escape (not Unicode text)"] += 1
            continue
        turns.append((mapped, content))
    # A conversation starts at its first user turn: assistant turns before it answer nothing.
    first_user = next((i for i, (role, _) in enumerate(turns) if role == "user"), None)
    if first_user is None:
        counters["records with no usable user turn"] += 1
        return None
    system = [t for t in turns[:first_user] if t[0] == "system"]
    if first_user - len(system) > 0:
        counters["leading assistant turns trimmed"] += first_user - len(system)
    return rec_id, tuple(system + turns[first_user:])


TEXT_PARTS = ("text", "input_text", "output_text")
"""The ``type`` of an OpenAI content part that holds text (chat completions, and the responses API's spellings)."""


def joined_text(parts: list) -> str | None:
    """The text of a turn written as OpenAI content parts, its text parts joined by newlines (as vLLM and the
    OpenAI servers join them), or None when a part is not text (an image, audio or file the prompt would lose)."""
    texts = [part.get("text") for part in parts if isinstance(part, dict) and part.get("type") in TEXT_PARTS]
    if len(texts) != len(parts) or not all(isinstance(text, str) for text in texts):
        return None
    return "\n".join(texts)


def printable(text: str) -> str:
    """``text`` with any lone surrogate written as its ``\\udXXX`` escape (valid Unicode, encodable)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_PART_SUFFIX = re.compile(r"_\d+$")


PART_GROUP_SHARE = 0.01
"""ShareGPT splits a long chat into records ``<base>_0``, ``<base>_1``, …, which must share a side of the held-out
split. A base whose parts hold more than this share of a source's records is a dataset numbering its records
(``example_0`` … ``example_999``), not one chat: its records keep their own ids (the packaged ShareGPT's longest
chat is 89 parts of 17,395 records, 0.5 %). The share makes the grouping depend on the file's size: rows added can
move a chat's parts across the split, so a calibration set lists its prompts' digests and an evaluation leaves those
out (:data:`pipeline.data.calibration.PROMPT_DIGESTS`)."""


def thaw(frozen: Iterable[Frozen]) -> list[Conversation]:
    """Conversations from normalised records, the parts of one chat (``<base>_<n>``) in one split group."""
    frozen = list(frozen)
    bases = [_PART_SUFFIX.sub("", cid) if _PART_SUFFIX.search(cid) else "" for cid, _ in frozen]
    parts, most = Counter(bases), max(1, int(len(frozen) * PART_GROUP_SHARE))
    return [Conversation(cid, [{"role": r, "content": c} for r, c in msgs], base if base and parts[base] <= most else "")
            for (cid, msgs), base in zip(frozen, bases)]


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield each complete element of a top-level JSON array, parsed one record at a time.

    Stops at the first element that does not parse (a truncated tail) by raising
    :class:`json.JSONDecodeError` (or the ``ValueError``/``RecursionError`` of a number too long or a record
    nested too deep for Python's parser); everything before it has been yielded.
    """
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0 or text[:start].strip():
        raise json.JSONDecodeError("expected a JSON array", text, max(start, 0))
    pos, count = start + 1, 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]
        if pos < len(text) and text[pos] == "]":
            after = _JSON_SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
            if after < len(text):
                raise DataAfterArray(after, count)
            return
        if pos >= len(text):
            return
        record, pos = decoder.raw_decode(text, pos)
        count += 1
        yield record


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


class DataAfterArray(ValueError):
    """A top-level JSON array followed by more than white space (``cat a.json b.json``, or JSON Lines whose lines are
    arrays): ``pos`` is where the rest starts, ``count`` the records of the array before it."""

    def __init__(self, pos: int, count: int) -> None:
        super().__init__(f"more JSON after the array at character {pos}")
        self.pos, self.count = pos, count


_NUMBER_PREFIX = re.compile(r"-?[0-9]*(\.[0-9]*)?([eE][-+]?[0-9]*)?")


def _text_ran_out(err: json.JSONDecodeError) -> bool:
    """Whether a parse error is the text ending mid-value (a truncated file) rather than a syntax error before its
    end: a string left open, or nothing but the start of a literal or a number after the error's position."""
    rest = err.doc[err.pos:].strip()
    return (err.msg.startswith("Unterminated string") or not rest or _NUMBER_PREFIX.fullmatch(rest) is not None
            or any(literal.startswith(rest) for literal in ("true", "false", "null")))


def parse_records(text: str, name: str, notes: list[str]) -> tuple[list[Any], int]:
    """Parse a JSON array (recovering complete records of a truncated one), one object, or JSON Lines.

    Returns the records and how many records were seen but could not be parsed.

    Raises:
        DrafterError: A JSON array with a syntax error before its end (not a truncation).
    """
    text = text.removeprefix("\ufeff")  # a byte order mark is no JSON
    stripped = text.lstrip()
    if stripped.startswith("["):
        records: list[Any] = []
        try:
            for record in iter_json_array(text):
                records.append(record)
        except DataAfterArray as err:
            line = text.count("\n", 0, err.pos) + 1
            raise DrafterError(
                f"{name} holds more JSON after its array: an array of {err.count} record(s) ends, then more data "
                f"starts at byte {len(text[:err.pos].encode('utf-8', 'surrogatepass'))} (line {line}).",
                expected="one JSON array of records with nothing but white space after its closing ']', or JSON "
                         "Lines (one record object per line)",
                found=f"{text[err.pos:err.pos + 60]!r} after the array (two files joined, or lines that are arrays?)",
                fix="Merge the arrays into one array, or write one record object per line as JSON Lines; reading "
                    "only the first array would silently drop every record after it.") from err
        except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            if not (isinstance(err, json.JSONDecodeError) and _text_ran_out(err)):
                # a syntax error before the end: recovering would silently drop every record after it
                if isinstance(err, json.JSONDecodeError):
                    what, where = err.msg, f"line {err.lineno}, column {err.colno}"
                    found = f"character {err.pos} of {len(text)}: {text[max(0, err.pos - 30):err.pos + 30]!r}"
                else:
                    what, where = f"a record Python cannot parse ({type(err).__name__})", "the next record"
                    found = str(err)[:120]
                raise DrafterError(
                    f"{name} is not valid JSON after its first {len(records)} records: {what} at {where}.",
                    expected="a JSON array of records, complete or cut short at its end (a truncated download: its "
                             "complete records are kept), or JSON Lines",
                    found=found,
                    fix="Fix the file there (a missing comma, quote or bracket?), or write it as JSON Lines, where a "
                        "bad line is dropped alone and counted.") from err
            notes.append(f"{name}: JSON ends in an incomplete record at character {err.pos} of {len(text)} "
                         f"({err.msg}); the {len(records)} complete records before it were recovered")
            return records, 1
        return records, 0
    try:  # one (possibly pretty-printed) object; JSON Lines with several lines fails with "Extra data"
        return [json.loads(text)], 0
    except (ValueError, RecursionError):
        pass
    records, bad = [], 0
    # JSON Lines ends a record at "\n" only: str.splitlines would also cut at U+2028, U+0085 and others that a
    # JSON string may hold unescaped.
    for line in text.split("\n"):
        line = line.removeprefix("\ufeff")  # the byte order mark of a BOM'd file joined on (cat a.jsonl b.jsonl)
        if line.strip():
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
                bad += 1
    if bad:
        notes.append(f"{name}: {bad} lines are not valid JSON and were dropped")
    return records, bad


NOT_TEXT = {
    b"\x1f\x8b": ("gzip-compressed", "decompress it (`gunzip -k {name}`)"),
    b"\x28\xb5\x2f\xfd": ("zstd-compressed", "decompress it (`zstd -d {name}`)"),
    b"BZh": ("bzip2-compressed", "decompress it (`bunzip2 -k {name}`)"),
    b"\xfd7zXZ\x00": ("xz-compressed", "decompress it (`xz -dk {name}`)"),
    b"PK\x03\x04": ("a zip archive", "unzip it"),
    b"PAR1": ("Parquet", "convert it to JSON Lines (e.g. pandas.read_parquet(...).to_json(out, orient='records', "
                         "lines=True)) or save it with datasets' save_to_disk and point at that directory"),
}
"""What a local source's first bytes say it is when it is not JSON text, and how to make it JSON text."""


def file_text(data: bytes, path: Path) -> str:
    """A local source's bytes as text: UTF-8 with an optional byte order mark (which is no part of the JSON).

    Raises:
        DrafterError: A compressed or Parquet file (named by its first bytes), or bytes that are not UTF-8.
    """
    for magic, (what, how) in NOT_TEXT.items():
        if data.startswith(magic):
            raise DrafterError(
                f"Conversation file {path} is {what} data, which is not read as a source.",
                expected="a ShareGPT-style .json array or .jsonl file as UTF-8 text, or a datasets.save_to_disk "
                         "directory",
                found=f"{what} data: its first bytes are {data[:len(magic)]!r}",
                fix=how.format(name=path.name) + " and point generate.source at the JSON/JSON Lines file it gives.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise DrafterError(
            f"Conversation file {path} is not valid UTF-8 (byte {err.start}: {data[err.start:err.start + 1]!r}).",
            expected="UTF-8 text (JSON is UTF-8)",
            found=f"{err.reason} at byte {err.start} of {len(data)}",
            fix=f"re-encode the file, e.g. `iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}`; "
                "guessing an encoding here could silently change the prompts",
        ) from err


def normalise_all(records: Iterable[Any], stem: str, counters: Counter[str]) -> list[Frozen]:
    """Normalised records. One without an id of its own is named by its content (``<stem>-<sha256 prefix>``, then
    ``-2``, ``-3`` … for repeats), not by its position: a record added or removed above it would otherwise rename
    every record below, move them across the held-out split (which hashes ids) and let training rows of an
    artifact built from the old file into the new file's held-out prompts."""
    kept, seen = [], Counter()
    for record in records:
        frozen = normalise_record(record, counters)
        if frozen is None:
            continue
        cid, msgs = frozen
        if not cid:
            digest = hashlib.sha256(json.dumps(msgs, ensure_ascii=False).encode()).hexdigest()[:16]
            seen[digest] += 1
            cid = f"{stem}-{digest}" + (f"-{seen[digest]}" if seen[digest] > 1 else "")
        kept.append((cid, msgs))
    return kept


def counter_notes(counters: Counter[str]) -> list[str]:
    return [f"{count} {what}" for what, count in sorted(counters.items())]
