"""A real one-node Slurm cluster for tests: Debian ``slurm-wlm`` + ``munge``, started under a temp dir, stopped after.

``slurmctld`` and ``slurmd`` run as root with a ``slurm.conf`` written here (``select/cons_tres`` on cores,
``proctrack/linuxproc``, ``task/none``, state and spool under the temp dir, free ports), ``munged`` as the
munge user (left running if it already was). ``SLURM_CONF`` points the client tools (and so ``drafter
submit``/``status``) at it for the fixture's lifetime. Needs root and the two packages; ``.ci/run`` installs
them (``apt-get install slurm-wlm munge``) and sets ``DRAFTER_REQUIRE_SLURM=1``, which turns a missing
installation into a failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.mlflow_server import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.host = socket.gethostname()
        self.procs: list[str] = []

    def write_conf(self) -> None:
        cpus = os.cpu_count() or 1
        mem_mb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")) ) // 1024 // 2
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=drafter-test", f"SlurmctldHost={self.host}", f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}", "AuthType=auth/munge", "MpiDefault=none",
            "ReturnToService=2", "MinJobAge=3600", "KillWait=5",
            f"NodeName={self.host} CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN",
            f"PartitionName=test Nodes={self.host} Default=YES MaxTime=INFINITE State=UP", ""]))

    def start(self, timeout: float = 60.0) -> None:
        self.write_conf()
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], check=True)
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([daemon, "-f", str(self.conf)], check=True)
            self.procs.append(daemon)
        os.environ["SLURM_CONF"] = str(self.conf)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip() == "idle":
                return
            time.sleep(1)
        raise RuntimeError(f"the test Slurm node did not come up in {timeout:.0f} s; logs in {self.root / 'log'}")

    def wait(self, job_ids: list[str], timeout: float = 900.0) -> None:
        """Until none of ``job_ids`` is queued or running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)], capture_output=True,
                                 text=True)
            if not out.stdout.strip():
                return
            time.sleep(2)
        raise TimeoutError(f"jobs {job_ids} still queued after {timeout:.0f} s; logs in {self.root}")

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True)
        for name in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            if pid_file.is_file():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)
        os.environ.pop("SLURM_CONF", None)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing or os.geteuid() != 0:
        why = f"Slurm binaries {missing} not installed" if missing else "not root (slurmd/munged need root)"
        if os.environ.get("DRAFTER_REQUIRE_SLURM") == "1":
            pytest.fail(f"{why}: `apt-get install -y slurm-wlm munge` as root (.ci/run does)")
        pytest.skip(f"{why}; .ci/run installs Slurm and runs these tests")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
