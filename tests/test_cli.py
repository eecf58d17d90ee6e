"""The ``drafter`` CLI: subcommands match jobs/, help is fast and documented, errors are clean."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs import STAGES
from jobs.cli import build_parser, main
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.engine.methods import stages_read
from pipeline.timing import interleaved_medians

ROOT = Path(__file__).resolve().parents[1]


def test_stage_subcommands_match_the_job_modules() -> None:
    modules = {p.stem for p in (ROOT / "jobs").glob("*.py") if p.stem not in ("__init__", "cli", "benches")}
    assert modules == set(STAGES), "every jobs/ module but the CLI's is a stage in jobs.STAGES, and vice versa"
    choices = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert set(STAGES) <= choices
    assert {"run", "tiny", "bench", "config", "pull", "report"} <= choices


def test_stage_modules_expose_main() -> None:
    import importlib

    for stage in STAGES:
        assert callable(importlib.import_module(f"jobs.{stage}").main)


def test_each_stage_names_its_summary_metrics_and_evaluate_each_bundles() -> None:
    """`drafter run`'s summary reads each recipe's SUMMARY (it used to hard-code 25 keys and forgot RDK's bundle)."""
    import importlib

    from pipeline.engine.methods import GATE_SETS

    for stage in STAGES:
        summary = importlib.import_module(f"jobs.{stage}").SUMMARY
        assert summary and all(isinstance(key, str) for key in summary), stage
    evaluate = importlib.import_module("jobs.evaluate").SUMMARY
    for gate in GATE_SETS.values():
        assert {gate.passed_metric, f"{gate.metric_prefix}.tau"} <= set(evaluate), gate.name


def test_every_bench_names_a_function_that_takes_its_options() -> None:
    import importlib
    import inspect

    from jobs.benches import BENCHES

    options = {action.dest for action in build_parser()._subparsers._group_actions[0].choices["bench"]._actions}
    for name, bench in BENCHES.items():
        module, _, function = bench.target.partition(":")
        parameters = inspect.signature(getattr(importlib.import_module(module), function)).parameters
        assert set(bench.options) <= set(parameters), name
        assert set(bench.options) - {"cfg"} <= options, name  # each is a `drafter bench` option


def test_status_wait_takes_a_positive_interval(capsys: pytest.CaptureFixture) -> None:
    """``--wait 0`` (or a negative one) polled squeue back to back for as long as a job ran."""
    for value in ("0", "-5", "nan"):
        with pytest.raises(SystemExit, match="^2$") as exited:  # argparse's usage error
            build_parser().parse_args(["status", "--wait", value])
        assert exited.value.code == 2 and "expected a positive number of seconds" in capsys.readouterr().err
    assert build_parser().parse_args(["status", "--wait", "30"]).wait == 30.0


def test_bench_steps_must_time_something(capsys: pytest.CaptureFixture) -> None:
    """``--steps 0`` timed nothing and printed NaN medians (and speedups) with exit 0."""
    for value in ("0", "-3", "2.5"):
        with pytest.raises(SystemExit, match="^2$") as exited:  # argparse's usage error
            build_parser().parse_args(["bench", "decode", "--steps", value])
        assert exited.value.code == 2 and "expected a positive number of timed steps" in capsys.readouterr().err
    assert build_parser().parse_args(["bench", "decode", "--steps", "3"]).steps == 3
    with pytest.raises(ValueError, match="at least one timed call, got repeats=0"):
        interleaved_medians({"a": lambda: None}, torch.device("cpu"), 0)


def test_bench_eval_without_counts_exits_2_naming_the_option(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "eval"]) == 2
    assert "`drafter bench eval` needs --counts DIR" in capsys.readouterr().err


def test_bench_eval_runs_the_methods_its_count_artifact_serves_and_says_which_it_leaves_out(
        tmp_path: Path, tiny_kit, capsys: pytest.CaptureFixture) -> None:
    """`drafter bench eval --counts DIR` on the default methods failed: DynaSpec, EAGLE-3 and RDK read artifacts
    besides the count artifact, which is all it is given. It now runs the others and names those it leaves out."""
    from jobs import run
    from tests.helpers import SMALL

    overrides = [f"workdir={tmp_path}", *SMALL, "evaluate.prompts_per_task=1", "evaluate.max_new_tokens=4",
                 "evaluate.gammas=[2]", "evaluate.sampling_check_samples=0",
                 "evaluate.law_check_generations=0", "evaluate.shortlists=[top_k_16]",
                 "evaluate.dynaspec_match=top_k_16",
                 "evaluate.tasks=[code]"]
    counts = run(load_config(None, overrides), ["count"])["count"]
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert main(["bench", "eval", "--config", str(empty), "--counts", str(counts.path), *overrides]) == 0
    out, err = capsys.readouterr()
    left = [m for m in PipelineConfig().evaluate.methods if stages_read([m])]
    assert left and f"bench eval: leaving out {', '.join(left)}" in err
    ran = [m for m in PipelineConfig().evaluate.methods if m not in left]
    assert all(f"| {m} " in out for m in ran), out
    assert main(["bench", "eval", "--config", str(empty), "--counts", str(counts.path), *overrides,
                 "evaluate.methods=[eagle3]"]) == 2
    assert "has no method to run" in capsys.readouterr().err


def test_library_never_imports_jobs() -> None:
    offenders = [str(p) for p in (ROOT / "pipeline").rglob("*.py")
                 if any(line.strip().startswith(("import jobs", "from jobs")) for line in p.read_text().splitlines())]
    assert not offenders


def test_help_is_fast_because_heavy_imports_are_lazy() -> None:
    """`drafter --help` must not import torch, transformers, mlflow or lightning."""
    code = ("import sys; from jobs.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'mlflow', 'lightning', 'datasets') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "HEAVY []" in out.stdout, out.stdout


def _help_texts(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal; fix it so line counts are stable
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    return {name: sub.format_help() for name, sub in commands.items()}


def test_every_command_help_is_short_and_points_to_the_config_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    texts = _help_texts(monkeypatch)
    long = {name: len(text.splitlines()) for name, text in texts.items() if len(text.splitlines()) >= 40}
    assert not long, f"--help of these commands runs to 40 lines or more: {long}"
    for name, text in texts.items():
        if name != "tiny":  # the one command that reads no config
            assert "drafter config --keys" in text, name
    for stage in STAGES:
        assert f"drafter config --keys {stage}" in texts[stage]
    assert texts["generate"].count("generate.") == 0  # the keys themselves are in the reference, not here


def test_config_keys_prints_every_key_with_its_marks(capsys: pytest.CaptureFixture) -> None:
    from pipeline.config.schema import INPUT_OVERRIDE, describe, excluded_fields
    from pipeline.config.sections import PipelineConfig

    assert main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines if line.startswith("  ") and not line.startswith("    ")}
    assert set(listed) == {key for key, *_ in describe(PipelineConfig)}
    for key, why in excluded_fields(PipelineConfig).items():
        assert ("[input:" if why == INPUT_OVERRIDE else "[run setting]") in listed[key], key
    assert "[run setting]" not in listed["generate.max_new_tokens"]


def test_config_keys_of_a_stage_lists_its_own_keys_first(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--keys", "generate"]) == 0
    out = capsys.readouterr().out
    assert "generate.max_new_tokens" in out and "Tokens generated per prompt" in out
    assert "count.top_k" not in out  # only the stage's own and the shared sections
    assert out.index("generate.max_new_tokens") < out.index("shared by every stage:") < out.index("target.model")
    assert main(["config", "--keys", "train_drafter.train"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:] if not line.startswith("    ")]
    assert keys and all(key.startswith("train_drafter.train.") for key in keys)


def test_config_keys_refuses_an_unknown_section_and_overrides(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--keys", "genrate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: No config key or section 'genrate'.") and "generate" in err
    assert main(["config", "--keys", "generate", "generate.limit=3"]) == 2
    assert "reads no config" in capsys.readouterr().err


def test_tiny_help_gives_the_build_time_of_each_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.tiny.spec import BUILD_MINUTES, PROFILES

    assert set(BUILD_MINUTES) == set(PROFILES)
    text = " ".join(_help_texts(monkeypatch)["tiny"].split())
    assert f"about {BUILD_MINUTES['default']:g} min on a quiet 2-core machine" in text
    assert f"about {BUILD_MINUTES['test']:g} min" in text


def test_pull_help_example_is_a_name_the_default_run_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from pipeline.config.sections import PipelineConfig
    from pipeline.evaluation.publish import REGISTRATION_FILES
    from pipeline.registry import registered_name

    refs = re.findall(r"drafter pull (\S+)@champion", _help_texts(monkeypatch)["pull"])
    registered = {registered_name(PipelineConfig().target.model, kind) for kind in REGISTRATION_FILES}
    assert refs and set(refs) <= registered, (refs, registered)


def test_type_error_names_the_type_with_the_right_article(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "generate.max_new_tokens=many"]) == 2
    err = capsys.readouterr().err
    assert "Set generate.max_new_tokens to an int." in err and " a int" not in err


def test_plan_columns_line_up_with_its_json(tmp_path: Path, tiny_kit, capsys: pytest.CaptureFixture) -> None:
    """`drafter plan`'s table on a real plan (ids and inputs of several lengths) holds the rows its --json gives, each
    value starting at its column; and the table itself keeps its columns with ids far longer than the header."""
    import json
    import re

    from jobs import cli
    from tests.helpers import SMALL

    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    args = ["plan", "--config", str(empty), f"workdir={tmp_path}", *SMALL, "--stages", "generate,count,evaluate"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    header, *lines = capsys.readouterr().out.splitlines()[: 1 + len(rows)]
    assert len({len(row["artifact_id"]) for row in rows}) > 1 and any(row["inputs"] for row in rows)
    columns = {name: header.index(name) for name in ("status", "inputs")}
    columns["artifact_id"] = re.search("artifact[ _]id", header).start()  # type: ignore[union-attr]
    for row, line in zip(rows, lines, strict=True):
        assert line.startswith(row["stage"] + " "), line
        assert line[columns["artifact_id"]:].startswith(row["artifact_id"] + " "), line
        assert line[columns["status"]:].startswith(row["status"]), line
        assert line[columns["inputs"]:] == (", ".join(f"{k}={v}" for k, v in row["inputs"].items()) or "—")
    long = [{"stage": "generate", "artifact_id": "generate-" + "0" * 40, "status": "cached", "inputs": None},
            {"stage": "count", "artifact_id": "count-1a2b", "status": "to run", "inputs": "generate=x"}]
    table = cli._table(long, ["stage", "artifact_id", "status", "inputs"]).splitlines()
    at = table[0].index("status")
    assert [line[at:].split()[0] for line in table[1:]] == ["cached", "to"] and table[1][at - 1] == " "


def test_bad_config_key_exits_2_with_one_clear_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "generate.max_new_tokenz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown config key 'generate.max_new_tokenz'") and "Traceback" not in err


def test_an_unknown_stage_exits_2_listing_the_stages_and_what_to_pass(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--stages", "generate,evalute"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown stage(s) ['evalute']") and "'evaluate'" in err
    assert "what to do: Pass --stages as a comma-separated list" in err and "Traceback" not in err


def test_config_prints_resolved_yaml(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--config", str(ROOT / "configs/tiny.yaml"), "generate.limit=7"]) == 0
    assert "limit: 7" in capsys.readouterr().out


# MLflow 3 sends usage data unless told not to; a pipeline process never does, unless the user opts in. Run in a
# fresh process whose environment has no CI or pytest markers (MLflow turns telemetry off by itself there).
TELEMETRY_PROBE = (
    "import sys; from jobs.cli import main\n"
    "main(sys.argv[1:])  # imports mlflow (the registry client) and fails: no store there\n"
    "print('IMPORTED BY MAIN', 'mlflow' in sys.modules)\n"
    "from mlflow.telemetry import get_telemetry_client\n"
    "print('TELEMETRY', 'off' if get_telemetry_client() is None else 'on')")


@pytest.mark.parametrize(("switch", "state"), [(None, "off"), ("false", "on"), ("true", "off")])
def test_mlflow_telemetry_is_off_unless_the_user_turns_it_on(tmp_path: Path, switch: str | None, state: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    if switch is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = switch
    out = subprocess.run([sys.executable, "-c", TELEMETRY_PROBE, "pull", "m@champion", "--to", "b",
                          f"workdir={tmp_path / 'w'}"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert "no MLflow store" in out.stderr and "IMPORTED BY MAIN True" in out.stdout, out.stdout + out.stderr
    assert f"TELEMETRY {state}" in out.stdout, out.stdout + out.stderr


def test_run_refuses_a_sqlite_store_in_a_missing_directory_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """MLflow would create /nonexistent/dir (as root: anywhere); the kit would take minutes to build first."""
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "nonexistent" / "dir" / "x.db"
    assert main(["run", f"workdir={tmp_path / 'w'}", f"mlflow.tracking_uri=sqlite:///{store}"]) == 2
    err = capsys.readouterr().err
    assert "in a directory that does not exist" in err and "mkdir -p" in err and "Traceback" not in err
    assert not (tmp_path / "nonexistent").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("override", ["=5", ".=5", "generate", "generate.max_new_tokens=" + "9" * 5000,
                                      "workdir.x=1"])
def test_a_malformed_override_exits_2_saying_what_was_expected(capsys: pytest.CaptureFixture, override: str) -> None:
    assert main(["config", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "expected:" in err and "what to do:" in err
