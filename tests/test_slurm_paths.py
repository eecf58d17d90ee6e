"""Job scripts under paths Slurm reads word by word, and a controller that does not answer.

Without Slurm: a ``workdir`` on two lines is refused (it went into the ``#SBATCH --output`` line, where its second line
ran as a shell command), a path with a space is quoted in the header, and the template keeps an interpreter path
with a space whole. On a real one-node Slurm: a stage under such a path is submitted, and the second submit knows
the job as its own, and a job whose SIGUSR1 requeue Slurm refuses runs its stage on to the end. With Slurm's own tools
pointed at a controller that is not there: ``job_state`` says Slurm did not answer, where it read the silence as a job
Slurm had forgotten and ``submit`` submitted the stage again.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.config.sections import load_config
from pipeline.errors import DrafterError
from pipeline.orchestration import slurm
from tests.helpers import SMALL, small_cfg
from tests.mlflow_server import MlflowServer, free_port
from tests.slurm_cluster import SlurmCluster


def test_a_workdir_on_two_lines_is_refused_and_a_path_with_a_space_is_quoted_in_the_header(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match=r"Invalid value for workdir\.\n  expected: a path on one line"):
        load_config(None, [f'workdir="{tmp_path}/x\\ntouch {tmp_path}/ran"'])
    cfg = small_cfg(tmp_path / "my runs", 'slurm.partition="gpu a"', """slurm.account='a"b\\c'""")
    script = slurm.render(cfg, "generate", cfg.workdir_path / "slurm" / "logs")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert f'#SBATCH --output="{tmp_path}/my runs/slurm/logs/generate-%j.out"' in header
    assert '#SBATCH --partition="gpu a"' in header and "#SBATCH --time=04:00:00" in header
    assert '#SBATCH --account="a\\"b\\\\c"' in header  # sbatch reads back a"b\c


def test_the_template_keeps_an_interpreter_path_with_a_space_whole(tmp_path: Path) -> None:
    """``drafter submit`` names its interpreter in DRAFTER_CMD, shell-quoted; the template split it on white space,
    so every job under a virtualenv in "my project" ran ``'/home/u/my``."""
    line = next(x for x in slurm.TEMPLATE.read_text().splitlines() if re.match(r"^(eval|read).*DRAFTER", x))
    python = str(tmp_path / "my project" / ".venv" / "bin" / "python")

    def words(env: dict[str, str]) -> list[str]:
        return subprocess.run(["bash", "-c", f'{line}\nprintf "%s\\n" "${{DRAFTER[@]}}"'], env=env, check=True,
                              capture_output=True, text=True).stdout.splitlines()

    assert words({"DRAFTER_CMD": f"{shlex.quote(python)} -m jobs.cli"}) == [python, "-m", "jobs.cli"]
    assert words({}) == ["drafter"]


@pytest.mark.slurm
def test_a_stage_under_a_path_with_a_space_is_submitted_and_known_as_its_own_job(
        tmp_path: Path, tiny_kit, slurm_cluster: SlurmCluster, mlflow_server: MlflowServer) -> None:
    """sbatch refused the header ("Invalid directive": the log path's second word), and once a job ran, its command
    cut at the space read as another job's, so a second submit submitted the stage again. A ``#`` cut the log path
    short there (sbatch reads the rest of the line as a comment) and a ``'`` made sbatch stop ("Unmatched")."""
    workdir = tmp_path / "bob's runs #2"
    cfg = load_config(None, [f'workdir="{workdir}"', *SMALL, f"mlflow.tracking_uri={mlflow_server.uri}",
                             "slurm.cpus_per_task=1", "slurm.extra=[--hold]"])
    jobs: list[str] = []
    try:
        (submitted,) = slurm.submit(cfg, ["generate"], [])
        jobs.append(submitted.job_id)
        assert submitted.status == "submitted"
        shown = slurm_cluster.tool("scontrol", "show", "job", submitted.job_id, check=True).stdout
        assert f"StdOut={workdir}/slurm/logs/generate-{submitted.job_id}.out\n" in shown, shown
        (again,) = slurm.submit(cfg, ["generate"], [])
        assert (again.job_id, again.status) == (submitted.job_id, "queued")
    finally:
        slurm_cluster.tool("scancel", *jobs)


@pytest.mark.slurm
def test_a_controller_that_does_not_answer_is_not_taken_for_a_forgotten_job(
        tmp_path: Path, slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """squeue's and scontrol's failure for any reason read as "Slurm no longer knows this job", and submit then
    submitted the stage again beside its running job."""
    silent = tmp_path / "slurm.conf"
    silent.write_text(re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", slurm_cluster.conf.read_text()))
    monkeypatch.setenv("SLURM_CONF", str(silent))
    with pytest.raises(DrafterError, match=r"Slurm did not answer \(squeue: .*(contact|connect)"):
        slurm.job_state("1")
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    assert slurm.job_state("999999").state is None  # one it does not know: still unknown, no error


@pytest.mark.slurm
def test_a_requeue_slurm_refuses_lets_the_stage_run_on_to_its_end(tmp_path: Path, slurm_cluster: SlurmCluster) -> None:
    """SIGUSR1 comes ``slurm.signal_seconds`` before the time limit and the template requeues the job. Where
    ``scontrol requeue`` failed (a job Slurm will not requeue, a controller restarting), the trap's failure ended the
    script under ``set -e`` and Slurm killed the stage with it, in the grace period it still had. The same when a
    requeue went through: ``wait`` came back early on the signal and the script ended before Slurm stopped the job."""
    stage = tmp_path / "stage.sh"
    stage.write_text('#!/bin/bash\necho "stage $1 started"\nsleep 6\necho "stage $1 ended"\n')
    stage.chmod(0o755)
    deadline = time.monotonic() + 180

    def signalled(name: str, *options: str) -> tuple[str, Path]:
        """Submit the template running ``stage``, send its script SIGUSR1 once the stage has started."""
        log = tmp_path / f"{name}.out"
        job_id = slurm_cluster.tool(
            "sbatch", "--parsable", *options, f"--output={log}", "--open-mode=append", f"--chdir={tmp_path}",
            f"--export=ALL,DRAFTER_CMD={shlex.quote(str(stage))}", str(slurm.TEMPLATE), name, "c.yaml",
            check=True).stdout.strip()
        while "started" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, f"the stage did not start: {log.read_text() if log.exists() else ''}"
            time.sleep(0.2)
        slurm_cluster.tool("scancel", "--batch", "--signal=USR1", job_id, check=True)
        return job_id, log

    refused, log = signalled("count", "--no-requeue")  # Slurm will not requeue this one
    while (state := slurm.job_state(refused).state) in slurm.ACTIVE:
        assert time.monotonic() < deadline, f"job {refused} still {state}"
        time.sleep(0.5)
    text = log.read_text()
    assert "SIGUSR1 before the time limit" in text and "could not requeue" in text, text
    assert "stage count ended" in text and state == "COMPLETED", (state, text)

    requeued, log = signalled("cluster")  # and one it requeues: back in the queue, its stage stopped
    try:
        while (shown := slurm_cluster.tool("scontrol", "show", "job", "-o", requeued).stdout) and \
                "Restarts=1" not in shown:
            assert time.monotonic() < deadline, f"job {requeued} not requeued: {shown}"
            time.sleep(0.5)
        assert "could not requeue" not in log.read_text() and "stage cluster ended" not in log.read_text()
    finally:
        slurm_cluster.tool("scancel", requeued)
