"""The ``drafter`` CLI: subcommands match jobs/, help is fast and documented, errors are clean."""

import subprocess
import sys
from pathlib import Path

import pytest

from jobs import STAGES
from jobs.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_stage_subcommands_match_the_job_modules() -> None:
    modules = {p.stem for p in (ROOT / "jobs").glob("*.py") if p.stem not in ("__init__", "cli")}
    assert modules == set(STAGES), "every jobs/ module is a stage listed in jobs.STAGES, and vice versa"
    choices = set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]
    assert set(STAGES) <= choices
    assert {"run", "tiny", "bench", "config", "pull", "report"} <= choices


def test_stage_modules_expose_main() -> None:
    import importlib

    for stage in STAGES:
        assert callable(importlib.import_module(f"jobs.{stage}").main)


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


def test_stage_help_lists_documented_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit, match="^0$"):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "generate.max_new_tokens" in out and "Tokens generated per prompt" in out
    assert "count.top_k" not in out  # only the stage's own and the shared sections


def test_bad_config_key_exits_2_with_one_clear_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "generate.max_new_tokenz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown config key 'generate.max_new_tokenz'") and "Traceback" not in err


def test_config_prints_resolved_yaml(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "--config", str(ROOT / "configs/tiny.yaml"), "generate.limit=7"]) == 0
    assert "limit: 7" in capsys.readouterr().out
