"""The sbatch scripts: valid bash, sane #SBATCH headers, and an `srun drafter ...` line that resolves
to a real subcommand with config overrides that exist (checked against the parser and config schema)."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from jobs import STAGES
from jobs.cli import build_parser
from pipeline.config.sections import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "slurm").glob("*.sbatch"))
SLURM_ENV = {"SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "16"}


def test_there_is_a_script_per_stage() -> None:
    assert {p.stem for p in SCRIPTS} >= set(STAGES)


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_is_valid_and_its_command_resolves(script: Path) -> None:
    text = script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert text.startswith("#!/bin/bash")
    assert re.search(r"^#SBATCH --job-name=\S+", text, re.M)
    assert re.search(r"^#SBATCH --time=\d", text, re.M)
    assert "set -euo pipefail" in text
    srun = " ".join(line.rstrip("\\").strip() for line in
                    text[text.index("srun drafter"):].splitlines() if line.strip())
    for var, value in SLURM_ENV.items():
        srun = srun.replace(f"${{{var}}}", value)
    argv = shlex.split(srun.replace('"$CONFIG"', "configs/tiny.yaml").replace('"$@"', ""))
    assert argv[:2] == ["srun", "drafter"] and argv[2] == script.stem
    args = build_parser().parse_args(argv[2:])
    cfg = load_config(ROOT / args.config, args.overrides)  # every override names a real key
    assert cfg is not None
