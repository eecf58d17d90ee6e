"""Building, caching and resolving tiny-model kits.

:func:`build_kit` runs the whole recipe for a profile (data → tokenizers → target → target-written
text → three drafters → measurements) into a temporary directory next to the cache entry and
renames it into place, so a kit directory is either complete or absent. An ``fcntl.flock`` lock per
kit makes a second process wait for the first and then find the kit cached; temporary directories left
by interrupted builds are removed under that lock, while the phases such a build finished (each model's trained
weights, the target's answers: :func:`_partial`) stay for the next build to resume from. :func:`resolve_tiny_ref` turns
``"tiny:<profile>/<role>"`` into a directory that ``from_pretrained`` loads, building on demand.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cache import default_cache_dir
from pipeline.checksums import sha256_file
from pipeline.errors import DrafterError
from pipeline.progress import heartbeat
from pipeline.tiny.spec import PROFILES, ROLES, get_profile, kit_hash

REPORT_FILE = "report.json"
REF_PREFIX = "tiny:"


@dataclass
class TinyKit:
    """A built kit: one model directory per role (:data:`~pipeline.tiny.spec.ROLES`) and its build report.

    Attributes:
        root: The kit directory, ``<cache>/tiny/<profile>-<hash>``.
        profile: Profile name.
        kit_hash: Content hash of the profile spec, the kit's code and the data identity.
        report: Contents of ``report.json``: losses, top-1 probabilities, agreement, parameter
            counts, build seconds and the data report.
    """

    root: Path
    profile: str
    kit_hash: str
    report: dict = field(default_factory=dict)

    def path(self, role: str) -> Path:
        """Directory of ``role`` loadable by ``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained``.

        Raises:
            DrafterError: ``role`` is not one of :data:`ROLES`.
        """
        if role not in ROLES:
            raise DrafterError(
                f"Unknown tiny-kit role '{role}'.", expected="one of " + ", ".join(ROLES), found=repr(role)
            )
        return self.root / role


def _kit_dir(profile: str, cache_dir: Path | None) -> tuple[Path, str]:
    digest = kit_hash(profile)
    parent = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return parent / "tiny" / f"{profile}-{digest}", digest


def _kit_files(root: Path) -> dict[str, str]:
    """sha256 of every file of every role, by path relative to the kit root."""
    return {str(f.relative_to(root)): sha256_file(f)
            for role in ROLES for f in sorted((root / role).rglob("*")) if f.is_file()}


def _verify(root: Path, report: dict) -> None:
    """Refuse a kit whose files differ from the hashes recorded when it was built (as artifacts are checked)."""
    recorded: dict[str, str] = report.get("sha256") or {}
    found = _kit_files(root)
    changed = sorted(name for name in recorded.keys() & found.keys() if recorded[name] != found[name])
    missing, added = sorted(recorded.keys() - found.keys()), sorted(found.keys() - recorded.keys())
    if changed or missing or added or not recorded:
        first = changed[0] if changed else None
        raise DrafterError(
            f"The tiny kit at {root} is not the one that was built: "
            + "; ".join(part for part in (
                f"{len(changed)} file(s) changed ({', '.join(changed[:3])})" if changed else "",
                f"missing {', '.join(missing[:3])}" if missing else "",
                f"added {', '.join(added[:3])}" if added else "",
                "no recorded hashes" if not recorded else "") if part),
            expected=f"{first}: sha256 {recorded[first][:16]}…" if first else "the files recorded in report.json",
            found=f"{first}: sha256 {found[first][:16]}…" if first else "other files",
            fix=f"Rebuild it: `drafter tiny --profile {report.get('profile', '<profile>')} --force` (or delete {root}).")


def _recorded_shape(recorded: object) -> bool:
    """Whether a report's ``sha256`` field has the shape the build writes (file name -> hex digest); absent is
    left to :func:`_verify` (\"no recorded hashes\")."""
    return recorded is None or (isinstance(recorded, dict)
                                and all(isinstance(k, str) and isinstance(v, str) for k, v in recorded.items()))


def _load_kit(root: Path, profile: str, digest: str, *, verify: bool = True) -> TinyKit | None:
    """The kit at ``root`` if it is complete (report present and every role saved), else None; with ``verify``,
    every file is checked against the sha256 recorded at build time.

    Raises:
        DrafterError: A complete kit whose files were changed, removed or added after it was built, or whose
            report cannot be read.
    """
    report_path = root / REPORT_FILE
    if not report_path.is_file() or not all((root / role / "config.json").is_file() for role in ROLES):
        return None
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        report = err
    if not isinstance(report, dict) or not _recorded_shape(report.get("sha256")):
        raise DrafterError(
            f"The tiny kit at {root} is damaged: its {REPORT_FILE} cannot be read.",
            expected=f"{REPORT_FILE} as the build wrote it (a JSON object with every file's sha256: an object of "
                     "file name -> hex digest)",
            found=f"{type(report).__name__}: {str(report)[:200]}" if isinstance(report, Exception)
            else f"a JSON {type(report).__name__}" if not isinstance(report, dict)
            else f"its sha256 field is a JSON {type(report['sha256']).__name__}: {str(report['sha256'])[:120]}",
            fix=f"Rebuild it: `drafter tiny --profile {profile} --force` (or delete {root}).")
    if verify:
        _verify(root, report)
    return TinyKit(root, profile, digest, report)


def build_kit(
    profile: str = "default",
    cache_dir: Path | None = None,
    *,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> TinyKit:
    """Build (or fetch from the cache) the tiny-model kit of a profile.

    Args:
        profile: ``"default"`` (the embedded default's kit) or ``"test"`` (what pytest builds); build
            times in :data:`~pipeline.tiny.spec.BUILD_MINUTES`.
        cache_dir: Cache root; None means :func:`default_cache_dir`.
        force: Rebuild even if the kit is cached, and from scratch: nothing kept by an interrupted build is reused.
        log: Receives progress lines.

    Returns:
        The kit; a cached one returns at once. A build after an interrupted one resumes after the phases it finished
        (:class:`pipeline.tiny.recipe.Phases`) and writes the same bytes.

    Raises:
        DrafterError: Unknown profile, the packaged data is missing, the cached kit is damaged, or the cache
            directory cannot be written (``DRAFTER_CACHE`` a file, read-only).
    """
    root, digest = _kit_dir(profile, cache_dir)
    if not force and (kit := _load_kit(root, profile, digest)) is not None:
        return kit
    lock_path = root.parent / f".{root.name}.lock"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "w")  # noqa: SIM115 - closed by the with below
    except OSError as err:  # DRAFTER_CACHE is a file, read-only, or not ours: say so instead of a traceback
        raise DrafterError(
            f"The tiny-kit cache at {root.parent} cannot be written: {type(err).__name__}: {err.strerror or err}",
            expected=f"a writable directory to build the kit into (and its lock file {lock_path.name})",
            found=str(err.filename or root.parent),
            fix="Set DRAFTER_CACHE to a writable directory (default ~/.cache/drafter-pipeline), or build the kit "
                f"where the cache is writable (`drafter tiny --profile {profile}`).") from err
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"tiny kit {root.name}: another process is building it; waiting")
            with heartbeat(f"tiny kit {root.name}: waiting for the other build", log):
                fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not force and (kit := _load_kit(root, profile, digest)) is not None:
                return kit  # built by the process we waited for
            _remove_stale(root, log)
            if force:  # a rebuild from scratch: nothing kept from an interrupted build either
                shutil.rmtree(_partial(root), ignore_errors=True)
            return _build_locked(profile, root, digest, log)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _partial(root: Path) -> Path:
    """Where a build of the kit at ``root`` keeps its finished phases until the kit is complete
    (:class:`pipeline.tiny.recipe.Phases`): an interrupted build's next run resumes from them."""
    return root.parent / f".{root.name}.partial"


def _remove_stale(root: Path, log: Callable[[str], None]) -> None:
    """Delete temp dirs of interrupted builds and an incomplete kit dir (we hold the lock); the phases an interrupted
    build finished stay (:func:`_partial`)."""
    for stale in root.parent.glob(f".{root.name}.tmp-*"):
        log(f"tiny kit {root.name}: removing {stale.name} left by an interrupted build")
        shutil.rmtree(stale, ignore_errors=True)
    if root.exists():
        shutil.rmtree(root)


def _build_locked(profile: str, root: Path, digest: str, log: Callable[[str], None]) -> TinyKit:
    from pipeline.tiny.recipe import build_into  # deferred: pulls in torch

    spec = get_profile(profile)
    log(f"tiny kit {root.name}: building profile '{profile}' (cached after this)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        start = time.perf_counter()
        report = build_into(spec, tmp, log, keep=_partial(root))
        report.update(profile=profile, kit_hash=digest, build_seconds=round(time.perf_counter() - start, 1),
                      sha256=_kit_files(tmp))
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True))
        os.rename(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(_partial(root), ignore_errors=True)
    log(f"tiny kit {root.name}: built in {report['build_seconds']} s")
    return TinyKit(root, profile, digest, report)


def parse_tiny_ref(ref: str) -> tuple[str, str]:
    """Split ``"tiny:<profile>/<role>"`` into ``(profile, role)`` without building anything.

    Raises:
        DrafterError: The reference is malformed or names an unknown profile or role.
    """
    body = ref[len(REF_PREFIX) :] if ref.startswith(REF_PREFIX) else None
    profile, _, role = (body or "").partition("/")
    valid = ", ".join(f"tiny:{p}/{r}" for p in sorted(PROFILES) for r in ROLES)
    if body is None or profile not in PROFILES or role not in ROLES:
        raise DrafterError(
            f"'{ref}' is not a tiny-kit reference.",
            expected=f"tiny:<profile>/<role>, one of: {valid}",
            found=repr(ref),
            fix="use one of those, or a local checkpoint directory / hub id for a real model",
        )
    return profile, role


def kit_weights(ref: str, tokenizer_ref: str | None = None, cache_dir: Path | None = None) -> str | None:
    """What names a kit model's weights in artifact ids: sha256 over the digests its build recorded for the
    files of its role (weights, config, tokenizer) and of ``tokenizer_ref``'s role; None while the kit is not built.

    The recipe hash names a kit's directory, not its bytes: the kit trains under bfloat16 autocast where the CPU
    multiplies bf16 natively and in float32 elsewhere, with kernels chosen per CPU, so the same recipe can build
    other weights on another machine (or after ``drafter tiny --force`` on a new torch). Reads ``report.json`` only;
    loading the kit checks every file against it.
    """
    profile, role = parse_tiny_ref(ref)
    tok_profile, tok_role = parse_tiny_ref(tokenizer_ref or ref)
    recorded: dict[str, str] = {}
    for prof, prefix in {(profile, f"{role}/"), (tok_profile, f"{tok_role}/")}:
        root, digest = _kit_dir(prof, cache_dir)
        kit = _load_kit(root, prof, digest, verify=False)
        if kit is None:
            return None
        recorded.update({f"{prof}:{name}": sha for name, sha in (kit.report.get("sha256") or {}).items()
                         if name.startswith(prefix)})
    return hashlib.sha256(json.dumps(recorded, sort_keys=True).encode("utf-8")).hexdigest()


def kit_status(profile: str, cache_dir: Path | None = None) -> tuple[Path, str, bool]:
    """Where a profile's kit lives, its content hash, and whether it is built — without building it."""
    root, digest = _kit_dir(profile, cache_dir)
    return root, digest, _load_kit(root, profile, digest, verify=False) is not None


def resolve_tiny_ref(ref: str, cache_dir: Path | None = None) -> Path:
    """Resolve ``"tiny:<profile>/<role>"`` to a model directory, building the kit on demand.

    Args:
        ref: e.g. ``"tiny:default/target"`` or ``"tiny:test/drafter_other"``.
        cache_dir: Cache root; None means :func:`default_cache_dir`.

    Returns:
        The role's directory (tokenizer and model, loadable by ``from_pretrained``).

    Raises:
        DrafterError: The reference is malformed or names an unknown profile or role.
    """
    profile, role = parse_tiny_ref(ref)
    # A first use builds the kit for minutes: say so on stderr, where it does not mix with output.
    return build_kit(profile, cache_dir, log=_stderr_line).path(role)


def _stderr_line(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] tiny kit: {line.strip()}", file=sys.stderr, flush=True)
