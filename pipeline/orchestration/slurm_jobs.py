"""What Slurm says about a submitted stage's job: ``squeue``, ``sacct`` and ``scontrol`` read back, and whether a
recorded job id still names the job ``drafter submit`` recorded (Slurm reuses ids).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from pipeline.errors import DrafterError

ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                    "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT"})
"""Job states in which a job will still produce its artifact (a resubmission reuses it)."""
ENDED_BADLY = frozenset({"FAILED", "TIMEOUT", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
"""Job states whose log says why (``status`` quotes it); NODE_FAIL too, which Slurm may suffix."""

def need(tool: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise DrafterError(f"`{tool}` is not on PATH: drafter submit/status need a Slurm client.",
                           expected=f"{tool} (Slurm's command-line tools)", found="not found",
                           fix="Run on a Slurm login node, or `drafter submit --dry-run` to see the scripts.")
    return found


@dataclass
class JobState:
    """What Slurm says about a job: its state, why, its exit code, its name and the script it runs (``None`` where
    Slurm has forgotten it, or does not say)."""

    state: str | None
    reason: str | None = None
    exit_code: str | None = None
    name: str | None = None
    command: str | None = None


def _unanswered(tool: str, out: subprocess.CompletedProcess) -> None:
    """Raise unless ``tool`` failed because it does not know the job: any other failure (a controller that timed out
    or is restarting) says nothing of the job, and reading it as "forgotten" made ``submit`` submit a running stage
    again."""
    said = (out.stderr or "").strip()[:200] or f"exit {out.returncode}"
    if out.returncode != 0 and "invalid job id" not in said.lower():
        raise DrafterError(f"Slurm did not answer ({tool}: {said}).",
                           expected="squeue and scontrol reaching the Slurm controller",
                           fix="Try again once the controller answers: nothing was submitted or changed.")


def job_state(job_id: str) -> JobState:
    """``squeue`` for live jobs, then ``sacct`` (accounting), then ``scontrol`` (jobs the controller still holds).

    Raises:
        DrafterError: ``squeue`` or ``scontrol`` failed for another reason than not knowing the job.
    """
    out = subprocess.run([need("squeue"), "-h", "-j", job_id, "-o", "%T|%r|%j|%o"], capture_output=True, text=True)
    _unanswered("squeue", out)
    if out.returncode == 0 and out.stdout.strip():
        state, reason, name, command = (out.stdout.strip().splitlines()[0].split("|", 3) + ["", ""])[:4]
        return JobState(state, None if reason in ("None", "") else reason, None, name or None, command or None)
    sacct = shutil.which("sacct")
    if sacct:
        out = subprocess.run([sacct, "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,ExitCode,JobName"],
                             capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            state, reason, code, name = (out.stdout.strip().splitlines()[0].split("|", 3) + ["", "", ""])[:4]
            return JobState(state.split()[0], reason or None, code or None, name or None)
    out = subprocess.run([need("scontrol"), "show", "job", "-o", job_id], capture_output=True, text=True)
    _unanswered("scontrol", out)
    if out.returncode == 0 and out.stdout.strip():
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        reason = fields.get("Reason")
        return JobState(fields.get("JobState"), None if reason in (None, "None") else reason, fields.get("ExitCode"),
                        fields.get("JobName"), fields.get("Command"))
    return JobState(None)


def _runs(command: str, script: str) -> bool:
    """Whether Slurm's ``command`` (squeue's: the script and its arguments; scontrol's: cut at the first space) is
    ``script`` (a path may hold a space)."""
    command = command.strip()
    return command == script or command.startswith(script + " ") or (
        script.startswith(command) and script[len(command):][:1].isspace())


def recorded_state(record: dict) -> JobState:
    """The state of the job a ``jobs.json`` record names, if that job id still names that job. Slurm reuses job ids
    (they wrap at ``MaxJobId``; a controller that lost its state starts again from ``FirstJobId``): a record's id may
    now name someone else's job, whose state says nothing of the stage's, and which ``submit`` would otherwise chain
    the stage's downstream jobs after. Such a record reads as a job Slurm no longer knows, with the reason."""
    state = job_state(record["job_id"])
    script, name = record.get("script"), f"drafter-{record['stage']}"
    other = (state.command is not None and script is not None and not _runs(state.command, script)) or (
        state.command is None and state.name is not None and state.name != name)
    if not other:
        return state
    return JobState(None, f"Slurm reused the recorded job id {record['job_id']}: it now names another job "
                          f"({state.name or '?'}, {state.command or 'script not reported'}), not this stage's "
                          f"{name} ({script})")
