"""The sbatch scripts: valid bash with sane #SBATCH headers, an ``srun drafter <stage>`` line naming a
real subcommand, and — the behaviour that matters — overrides that only say *where* the stage runs:
each script plans exactly the artifacts that ``drafter <stage>`` with the same config plans, so a job
resubmitted on other hardware, or the next stage of the chain on another node, finds them."""

import re
import subprocess
from pathlib import Path

import pytest

from jobs import STAGES
from pipeline.orchestration.dag import plan
from tests.test_dag import sbatch_overrides
from tests.test_stages import small_cfg

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "slurm").glob("*.sbatch"))


def test_there_is_a_script_per_stage() -> None:
    assert {p.stem for p in SCRIPTS} >= set(STAGES)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_is_valid_bash_with_a_slurm_header(script: Path) -> None:
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert text.startswith("#!/bin/bash") and "set -euo pipefail" in text
    assert re.search(r"^#SBATCH --job-name=\S+", text, re.M)
    assert re.search(r"^#SBATCH --time=\d", text, re.M)
    assert re.search(rf"^srun drafter {script.stem} --config \"\$CONFIG\"", text, re.M)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_plans_the_same_artifacts_as_the_plain_command(script: Path, tmp_path: Path, tiny_kit) -> None:
    overrides = sbatch_overrides(script.name)
    on_slurm = plan(small_cfg(tmp_path, *overrides), [script.stem])
    plain = plan(small_cfg(tmp_path), [script.stem])
    assert {n: s.id for n, s in on_slurm.stages.items()} == {n: s.id for n, s in plain.stages.items()}
