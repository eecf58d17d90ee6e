"""The ``drafter`` command: one subcommand per stage in ``jobs.STAGES``, plus ``run``, ``pull``,
``report``, ``config``, ``tiny`` and ``bench``.

Every stage subcommand takes ``--config FILE`` (default ``configs/tiny.yaml`` when present, else the
built-in defaults, which are the same tiny setup) and any number of ``key.path=value`` overrides, e.g.
``drafter generate generate.max_new_tokens=64 mlflow.experiment=dev``. ``--help`` is short (usage, what
the command does, where its keys are documented); the config reference — every key with its type,
default and the documentation written under the config field — is ``drafter config --keys [SECTION]``.
Heavy libraries are imported only inside the commands, so ``drafter --help`` answers at once. Errors a
user can cause print as one clear message (exit code 2), never as a traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jobs import STAGES, run
from jobs.benches import BENCHES, run_bench
from pipeline.artifacts import load_artifact
from pipeline.config.reference import config_reference
from pipeline.config.schema import to_dict
from pipeline.config.sections import load_config
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint
from pipeline.orchestration import dag, slurm
from pipeline.orchestration.dag import default_stages, plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import log
from pipeline.progress import LOG_INTERVAL_S, duration
from pipeline.registry import pull
from pipeline.tiny import build_kit
from pipeline.tiny.spec import BUILD_MINUTES
from pipeline.tracking import redact, tracking_uri

DEFAULT_CONFIG = Path("configs/tiny.yaml")


KEYS_EPILOG = ("config keys: `drafter config --keys STAGE` lists a stage's keys (type, default, meaning);\n"
               "`drafter config --keys` lists every key.")


def _stage_summary(stage: str) -> str:
    """The first line of the stage recipe's docstring, read without importing the recipe (heavy imports)."""
    from importlib.util import find_spec

    spec = find_spec(f"jobs.{stage}")
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) if spec and spec.origin else None
    return (doc or f"Stage {stage!r}.").splitlines()[0].replace("``", "`")


class _LazyHelp(argparse.ArgumentParser):
    """Reads a stage's description only when ``--help`` is actually asked for (keeps startup fast)."""

    stage_name: str | None = None

    def format_help(self) -> str:
        if self.stage_name:
            self.description = (f"{_stage_summary(self.stage_name)}\nRuns this stage alone; the upstream "
                                "stages it needs are reused from the cache or built first.")
            self.epilog = (f"config keys: `drafter config --keys {self.stage_name}` lists this stage's keys "
                           "(type, default, meaning);\n`drafter config --keys` lists every key.")
        return super().format_help()


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help=f"YAML config (default: {DEFAULT_CONFIG} if it exists, else built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides")


def _add_plan_args(parser: argparse.ArgumentParser, json_help: str) -> None:
    """--config, overrides, --stages and --json: what plan, submit and status share."""
    _add_config_args(parser)
    parser.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)} (with upstreams)")
    parser.add_argument("--json", action="store_true", help=json_help)


def _positive(kind: type, unit: str) -> Callable[[str], float]:
    """An argparse type for a positive ``kind`` of ``unit``: ``status --wait``'s seconds (0 polled Slurm back to back),
    ``bench --steps`` (0 timed nothing, and every median printed was NaN)."""
    def read(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, not {text!r}")
        return value
    return read


def build_parser() -> argparse.ArgumentParser:

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="drafter", formatter_class=lambda prog: raw(prog, max_help_position=20),  # a command name per line
        description="Train, calibrate, validate and register drafter artifacts for speculative decoding.\n"
                    "A stage's command runs that stage alone; its upstream stages are reused or built.",
        epilog="Each command's usage: `drafter COMMAND --help`.\n" + KEYS_EPILOG)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_LazyHelp)
    for spec in dag.STAGES:
        p = sub.add_parser(spec.name, help=f"stage → {spec.kind.replace('_', ' ')} artifact", formatter_class=raw)
        p.stage_name = spec.name  # type: ignore[attr-defined]
        _add_config_args(p)
        p.add_argument("--expect-id", default=None, metavar="ID",
                       help="run only if the config still plans this artifact id, its inputs already built "
                            "(what `drafter submit` passes each job)")
    p = sub.add_parser("run", help="run every stage in order and print a summary", formatter_class=raw,
                       description="Run every stage (or --stages) in DAG order, reusing cached artifacts, and "
                                   "print a summary.", epilog=KEYS_EPILOG)
    _add_config_args(p)
    p.add_argument("--stages", default=None, help=f"comma-separated subset of {','.join(STAGES)}")
    p = sub.add_parser("plan", help="each stage's artifact id, cached or to run (runs nothing)", formatter_class=raw,
                       description="Print each stage's artifact id, its inputs, and whether it is cached or "
                                   "would run.\nNothing runs.", epilog=KEYS_EPILOG)
    _add_plan_args(p, "print the plan as JSON (for CI)")
    p = sub.add_parser("submit", help="submit the stages not cached as chained Slurm jobs", formatter_class=raw,
                       description="Submit every stage that is not cached as a Slurm job, chained with afterok "
                                   "dependencies,\nand print the job table (resources: `drafter config --keys "
                                   "slurm`).", epilog=KEYS_EPILOG)
    _add_plan_args(p, "print the job table as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch scripts and submit nothing")
    p = sub.add_parser("status", help="each stage's artifact and job state, and why a job failed", formatter_class=raw,
                       description="Print each stage's artifact and Slurm job state (squeue/sacct), and why a "
                                   "job failed or was cancelled.", epilog=KEYS_EPILOG)
    _add_plan_args(p, "print the status as JSON")
    p.add_argument("--wait", type=_positive(float, "seconds"), default=None, metavar="SECONDS",
                   help="poll every SECONDS until no job is queued or running; exit 1 unless every stage's artifact "
                        "exists (for CI)")
    p = sub.add_parser("config", help="the resolved config, or with --keys what every key means", formatter_class=raw,
                       description="Print the resolved config (--config FILE plus overrides) as YAML.\n"
                                   "With --keys, print the config reference instead: every key (or SECTION's) "
                                   "with its type,\nbuilt-in default and meaning; [run setting] marks keys "
                                   "that are not part of any artifact id,\n[input] marks upstream artifact "
                                   "paths (their artifact id enters the id).\n"
                                   "E.g. `drafter config --keys count`, `drafter config count.top_k=[64,128]`.")
    p.add_argument("--keys", nargs="?", const="", default=None, metavar="SECTION",
                   help="list every config key, or those under SECTION (a stage, target, mlflow, slurm, or a "
                        "dotted prefix such as train_drafter.train)")
    _add_config_args(p)
    p = sub.add_parser("pull", help="download a registered bundle and verify every sha256", formatter_class=raw,
                       description="Download a registered bundle, verify every sha256 and fingerprint, and "
                                   "write it to --to, e.g.\n"
                                   "  drafter pull drafter-tiny-default-target-draft-vocab@champion --to ./bundle\n"
                                   "The MLflow store is the config's (`drafter config --keys mlflow`).",
                       epilog=KEYS_EPILOG)
    p.add_argument("ref", help="NAME@ALIAS or NAME/VERSION of a registered bundle")
    p.add_argument("--to", type=Path, required=True, help="destination directory (must be new or empty)")
    p.add_argument("--expect-target", default=None,
                   help="refuse the bundle unless it was built for this target model (name or tiny ref)")
    p.add_argument("--expect-revision", default=None,
                   help="the revision of --expect-target your serving pins (a hub model's branch, tag or commit)")
    _add_config_args(p)
    p = sub.add_parser("report", help="an evaluation's table (default: the one the config plans)", formatter_class=raw,
                       description="Print the evaluation table of an evaluation artifact (default: the one the "
                                   "config plans, once built)\nand the path of its report.html.",
                       epilog=KEYS_EPILOG)
    p.add_argument("--artifact", type=Path, default=None, help="an evaluation artifact directory")
    _add_config_args(p)
    p = sub.add_parser("tiny", help="build the tiny-model kit the defaults use",
                       formatter_class=raw,
                       description="Build the tiny-model kit (tokenizers, a tiny target and its drafters) that "
                                   "the built-in defaults use,\ncached under $DRAFTER_CACHE or "
                                   "~/.cache/drafter-pipeline. Takes no config.\n"
                                   "DRAFTER_KIT_PRECISION=float32 trains it in float32 even where the CPU has bf16.")
    p.add_argument("--profile", default="default", choices=sorted(BUILD_MINUTES),
                   help=f"default: the embedded default's kit, about {BUILD_MINUTES['default']:g} min on a quiet "
                        f"2-core machine (longer on a busy one); test: what pytest builds, about "
                        f"{BUILD_MINUTES['test']:g} min")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p = sub.add_parser("bench", help="benchmarks: ratios against a baseline of the same run",
                       formatter_class=raw,
                       description="Benchmarks that print ratios against a baseline measured in the same run:\n"
                                   + "\n".join(f"  {name:<11} {b.description}" for name, b in BENCHES.items()),
                       epilog=KEYS_EPILOG)
    p.add_argument("what", choices=list(BENCHES), help="which benchmark (listed above)")
    p.add_argument("--steps", type=_positive(int, "timed steps"), default=10,
                   help="timed repetitions of each variant (default 10)")
    p.add_argument("--shape", default="tiny", choices=("tiny", "llama3-8b"), metavar="SHAPE",
                   help="decode: tiny (the kit) or llama3-8b (also 8B; CUDA)")
    p.add_argument("--methods", default=None, metavar="A,B", help="decode: only these methods (default: all it times)")
    p.add_argument("--cold", action="store_true", help="decode: bare forwards timed with cold caches")
    p.add_argument("--tokens", type=int, default=2_000_000, help="count: synthetic calibration tokens")
    p.add_argument("--calibration", default=None, metavar="DIR", help="count: a calibration artifact to count instead")
    p.add_argument("--counts", default=None, help="eval: the count artifact whose shortlists to evaluate")
    p.add_argument("--out", default=None, help="eval: write report.json/html/md here")
    _add_config_args(p)
    return parser


def _load(args: argparse.Namespace):

    path = args.config
    if path is None and DEFAULT_CONFIG.is_file():
        path = DEFAULT_CONFIG
    return load_config(path, args.overrides)


def _summary(cfg, artifacts: dict) -> str:

    lines = ["", "summary", "-------"]
    for stage, art in artifacts.items():
        # each stage's recipe names its headline metrics (evaluate's: each bundle's, from the method registry)
        keys = [k for k in importlib.import_module(dag.spec(stage).job).SUMMARY if k in art.metrics]
        figures = ", ".join(f"{k}={art.metrics[k]}" for k in keys)
        lines.append(f"{stage:<14} {art.id}  {figures}")
        lines.append(f"{'':<14} {art.path}")
        from pipeline.evaluation.publish import REGISTRATION_FILES  # deferred: pulls in numpy

        store = redact(tracking_uri(cfg.mlflow, cfg.workdir_path))
        for suffix in REGISTRATION_FILES.values():
            registration = art.path.parent / f"{art.id}.{suffix}"
            if registration.is_file():
                try:
                    reg = json.loads(registration.read_text())
                    if reg.get("store", store) != store:
                        continue  # registered in another store, not in this one
                    lines.append(f"{'':<14} registered {reg['name']} version {reg['version']} aliases "
                                 f"{reg['aliases']} ({reg['reason']})")
                except (OSError, ValueError, AttributeError, KeyError):  # rerunning evaluate registers it again
                    lines.append(f"{'':<14} {registration.name} is damaged: run again to check the registration")
    if "evaluate" in artifacts:
        lines += ["", artifacts["evaluate"].file("report.md").read_text().rstrip(),
                  f"report: {artifacts['evaluate'].file('report.html')}"]
    uri = tracking_uri(cfg.mlflow, cfg.workdir_path)
    lines.append(f"MLflow runs: experiment {cfg.mlflow.experiment!r} at {redact(uri)}")
    if uri.startswith("sqlite:"):
        lines.append(f"  browse them with: mlflow ui --backend-store-uri {uri}")
    return "\n".join(lines)


def _pull(args: argparse.Namespace, cfg) -> int:

    expect = None
    if args.expect_revision and not args.expect_target:
        raise DrafterError("--expect-revision is the revision of --expect-target, which is missing.",
                           fix="Pass --expect-target MODEL with it.")
    if args.expect_target:

        expect = fingerprint(args.expect_target, args.expect_revision)
    path = pull(args.ref, args.to, cfg.mlflow, cfg.workdir_path, expect_fingerprint=expect)
    if expect is not None:
        print(f"pulled {args.ref} -> {path} (every sha256 verified; built for your target {args.expect_target})")
        return 0
    built_for = json.loads((path / "bundle.json").read_text())["fingerprint"]
    print(f"pulled {args.ref} -> {path} (every sha256 verified; built for target {built_for.get('model')} at "
          f"revision {built_for.get('revision')}, not checked against yours: pass --expect-target MODEL to refuse "
          "a bundle built for another)")
    return 0


def _report(args: argparse.Namespace, cfg) -> int:

    path = args.artifact
    if path is None:  # the evaluation this config plans: the newest in the workdir may be another config's
        step = plan(cfg, ["evaluate"])["evaluate"]
        if not step.cached:
            found = sorted((cfg.workdir_path / "artifacts").glob("evaluate-*/manifest.json"),
                           key=lambda p: p.stat().st_mtime)
            raise DrafterError(
                f"The evaluation this config plans, {step.id}, is not built.",
                expected=f"{step.path}",
                found=(f"other evaluations in {cfg.workdir_path / 'artifacts'}, the newest {found[-1].parent.name}"
                       if found else f"no evaluation under {cfg.workdir_path / 'artifacts'}"),
                fix="Run `drafter evaluate` (or `drafter run`) with this config first, or pass --artifact DIR to "
                    "print another evaluation.")
        path = step.path
    artifact = load_artifact(path, kind="evaluation")
    print(artifact.file("report.md").read_text(), end="")
    print(f"\nfull report: {artifact.file('report.html')}")
    return 0


def _run(args: argparse.Namespace, launch: Launch) -> int:
    cfg = _load(args)
    if args.command == "pull":
        return _pull(args, cfg)
    if args.command == "report":
        return _report(args, cfg)
    if args.command == "config":
        import yaml


        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.command == "plan":
        return _plan(args, cfg)
    if args.command in ("submit", "status"):
        return _slurm(args, cfg)
    if args.command in STAGES:
        if args.expect_id:
            slurm.check_submitted(cfg, args.command, args.expect_id)
        artifacts = run(cfg, [args.command], launch)
        if args.command in artifacts:
            print(_summary(cfg, {args.command: artifacts[args.command]}))
        return 0
    artifacts = run(cfg, _wanted(args, cfg), launch)
    if artifacts:
        print(_summary(cfg, artifacts))
    return 0


def _wanted(args: argparse.Namespace, cfg) -> tuple[str, ...]:
    """The stages ``--stages`` names, else the config's default run (every stage but the opt-in ones it does not
    ask for: ``default_stages``)."""
    wanted = default_stages(cfg) if not args.stages else tuple(s.strip() for s in args.stages.split(","))
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise DrafterError(f"Unknown stage(s) {unknown}.", expected=f"some of {list(STAGES)}",
                           fix="Pass --stages as a comma-separated list of those names (a stage's upstreams run "
                               "with it), or leave --stages out for the config's default run.")
    return wanted


def _table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(row[c]) if row[c] not in (None, []) else "—" for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _slurm(args: argparse.Namespace, cfg) -> int:

    wanted = list(_wanted(args, cfg))
    if args.command == "status":
        rows = [row.to_dict() for row in slurm.status(cfg, wanted)]
        started, said, last = time.monotonic(), None, 0.0
        while args.wait is not None and any(row["state"] in slurm.ACTIVE for row in rows):
            states = ", ".join(f"{row['stage']} {row['state']}" for row in rows if row["state"] in slurm.ACTIVE)
            poll = time.monotonic() + args.wait
            while True:  # a line when the states change and every 30 s (CI's --wait 300 lasts hours)
                if states != said or time.monotonic() - last >= LOG_INTERVAL_S:
                    log("status", f"waiting ({duration(time.monotonic() - started)}): {states}")
                    said, last = states, time.monotonic()
                if (left := poll - time.monotonic()) <= 0:
                    break
                time.sleep(min(LOG_INTERVAL_S, left))
            rows = [row.to_dict() for row in slurm.status(cfg, wanted)]
        # with --wait the verdict is the store's: a job can end COMPLETED without publishing, or vanish from
        # Slurm's memory after failing, or sit SUSPENDED or PREEMPTED; only the artifacts say the chain is done
        verdict = 0 if args.wait is None or all(row["artifact"] and not row["unregistered"] for row in rows) else 1
        if args.json:
            print(json.dumps(rows, indent=2))
            return verdict
        for row in rows:
            row["artifact"] = "yes" if row["artifact"] else "no"
        print(_table(rows, ["stage", "artifact_id", "artifact", "job_id", "state", "why"]))
        if verdict:
            print(f"\nnot done: {', '.join(r['stage'] for r in rows if r['artifact'] == 'no' or r['unregistered'])} "
                  "(see `why`)")
        return verdict
    submitted = slurm.submit(cfg, wanted, list(args.overrides), dry_run=args.dry_run)
    rows = [row.to_dict() for row in submitted]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if args.dry_run:
        for row in rows:
            if row["script"]:
                print(f"# ---- {row['stage']} ({row['artifact_id']}) ----\n{row['script']}")
    for row in rows:
        row["depends_on"] = ",".join(row["depends_on"]) or None
    print(_table(rows, ["stage", "job_id", "depends_on", "artifact_id", "status"]))
    new = sum(row["status"] == "submitted" for row in rows)
    print(f"\n{new} job(s) submitted" + ("" if args.dry_run else "; `drafter status` follows them"))
    return 0


def _plan(args: argparse.Namespace, cfg) -> int:

    wanted = _wanted(args, cfg)
    the_plan = plan(cfg, wanted)
    to_run = set(the_plan.needed(wanted))
    rows = [kit.row() for kit in the_plan.kits] + the_plan.table()
    for row in rows:
        if row["status"] == "to run" and row["stage"] not in to_run:
            row["status"] = "not needed"  # an upstream whose artifact the config names directly
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        row["inputs"] = ", ".join(f"{k}={v}" for k, v in row["inputs"].items()) or None
    print(_table(rows, ["stage", "artifact_id", "status", "inputs"]))
    print(f"\n{sum(r['status'] == 'to run' for r in rows)} stage(s) to run; artifacts under "
          f"{cfg.workdir_path / 'artifacts'}")
    if the_plan.provisional:
        print("The ids are provisional until the tiny kit is built: a kit model's id names the files it is built "
              "into, which differ from machine to machine (`drafter run` builds the kit first).")
    return 0


TELEMETRY_SWITCH = "MLFLOW_DISABLE_TELEMETRY"


def _no_usage_data() -> None:
    """MLflow 3 sends usage data to its maintainers unless ``MLFLOW_DISABLE_TELEMETRY`` (or ``DO_NOT_TRACK``) is
    set. The pipeline sends nothing anywhere: telemetry is off in this process and in every process it starts
    (Lightning ranks, Slurm jobs inherit the environment), unless the user set the switch themselves
    (``MLFLOW_DISABLE_TELEMETRY=false`` turns it on)."""
    if TELEMETRY_SWITCH not in os.environ:
        os.environ[TELEMETRY_SWITCH] = "true"
        if "mlflow.telemetry" in sys.modules:  # imported before main() ran (an embedding program): decide again
            from mlflow.telemetry import set_telemetry_client

            set_telemetry_client()


def main(argv: list[str] | None = None) -> int:
    launch = Launch.from_environ()  # how this process was started, read before any stage's Lightning changes it
    _no_usage_data()
    parser = build_parser()
    # Overrides may come after options too (`drafter pull REF --to DIR workdir=...`): argparse stops
    # filling a positional list at the first option, so collect the stragglers here.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]

    try:
        if args.command == "config" and args.keys is not None:
            if args.config or args.overrides:
                raise DrafterError("`drafter config --keys` lists the built-in defaults; it reads no config.",
                                   expected="drafter config --keys [SECTION]",
                                   found=" ".join([*(["--config", str(args.config)] if args.config else []),
                                                   *args.overrides]),
                                   fix="Drop --config and the overrides, or run `drafter config` without --keys "
                                       "to print a resolved config.")
            print(config_reference(args.keys or None))
            return 0
        if args.command == "tiny":

            kit = build_kit(args.profile, force=args.force, log=lambda line: log("tiny kit", line.strip()))
            print(json.dumps({"root": str(kit.root), "kit_hash": kit.kit_hash, **kit.report}, indent=2,
                             default=str))
            return 0
        if args.command == "bench":
            print(run_bench(args.what, lambda name: _load(args) if name == "cfg" else getattr(args, name)))
            return 0
        return _run(args, launch)
    except DrafterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Destroy torch's process group, if a multi-rank stage set one up, before the process exits.

    Lightning leaves it alive after ``fit``/``predict``. A rank that exits with a live gloo group can abort in its
    teardown ("terminate called without an active exception"): seen on a two-node job whose rank 1 finished first,
    after rank 0 had published, and ``srun --kill-on-bad-exit`` then failed the whole job. Only where torch is
    already imported (``--help`` and the config commands never import it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
