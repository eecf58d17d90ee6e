"""Real Slurm clusters for tests: Debian ``slurm-wlm`` + ``munge``, started under a temp dir, stopped after.

Two layouts, both on this machine alone. The one-node cluster (``slurm_cluster``) runs ``slurmctld`` and one
``slurmd`` named after this host. The two-node cluster (``two_node_slurm``) runs two ``slurmd`` (Debian builds
Slurm with multiple-slurmd support), ``nodeA`` and ``nodeB``, each with one CPU, at its own loopback address
(``NodeAddr`` 127.0.0.2 and 127.0.0.3: Linux routes all of 127/8 to ``lo``, and the controller stays on 127.0.0.1),
at its own port and in its own UTS namespace (``unshare --uts``), so a job step on each node sees that node's name
as its host name — as on a real cluster. Those names resolve nowhere: a job must reach its first node by
``NodeAddr``, which is what ``slurm/stage.sbatch`` does, and the distinct addresses tell the first node's from the
second's and from the controller's. Both use ``select/cons_tres`` on cores, ``proctrack/linuxproc``,
``task/none``, state and spool under the temp dir and free ports; ``munged`` runs as the munge user (left
running if it already was). Daemons are stopped by the pids in their pid files.

Each cluster is started once per session; the fixtures a test uses point the client tools (and so ``drafter
submit``/``status``) at that cluster by setting ``SLURM_CONF`` for the test only (:meth:`SlurmCluster.active`),
so both clusters can live in one pytest process. Needs root and the two packages; ``.ci/run`` installs them
(``apt-get install slurm-wlm munge``) and sets ``DRAFTER_REQUIRE_SLURM=1``, which turns a missing
installation into a failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers import skip_unless
from tests.mlflow_server import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "unshare")
TWO_NODES = ("nodeA", "nodeB")
TWO_NODE_CLUSTER = "drafter-test-nodes"
"""The two-node cluster's ClusterName (its jobs see it as ``SLURM_CLUSTER_NAME``)."""


class SlurmCluster:
    """A test cluster under ``root``. ``nodes`` None: one node, this host, on 127.0.0.1; else one ``slurmd`` per
    name, each in its own UTS namespace at its own address (:attr:`addresses`)."""

    def __init__(self, root: Path, nodes: tuple[str, ...] | None = None) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.host = socket.gethostname()
        self.multi = nodes is not None
        self.nodes = nodes or (self.host,)
        self.addresses = {name: f"127.0.0.{2 + i}" if self.multi else "127.0.0.1" for i, name in enumerate(self.nodes)}
        """Each node's ``NodeAddr``."""

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with the client tools pointed at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @contextmanager
    def active(self) -> Iterator[SlurmCluster]:
        """``SLURM_CONF`` points at this cluster inside the block (and back to what it was after)."""
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", str(self.conf))
            yield self

    def tool(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(args), capture_output=True, text=True, env=self.env, check=check)

    def requeue(self, job_id: str, timeout: float = 120.0) -> None:
        """``scontrol requeue`` a running job and let it start again at once. Slurm gives a requeued job a begin time
        (a back-off of about 2.5 min here) once its tasks have stopped; that begin time is moved to now when the job
        is back in the queue (PENDING). An update sent before that races the requeue and changes nothing."""
        self.tool("scontrol", "requeue", job_id, check=True)
        deadline = time.monotonic() + timeout
        while (state := self.tool("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()) != "PENDING":
            assert time.monotonic() < deadline, f"job {job_id} not back in the queue after {timeout:.0f} s: {state!r}"
            time.sleep(0.5)
        self.tool("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=True)

    def first_node(self, job_id: str) -> str:
        """The first node of job ``job_id``'s allocation (the controller keeps an ended job for MinJobAge)."""
        shown = self.tool("scontrol", "show", "job", "-o", job_id, check=True).stdout
        (node_list,) = (field.split("=", 1)[1] for field in shown.split() if field.startswith("NodeList="))
        return self.tool("scontrol", "show", "hostnames", node_list, check=True).stdout.split()[0]

    def write_conf(self) -> None:
        mem_mb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal"))) // 1024 // 2
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        if self.multi:
            for name in self.nodes:
                (self.root / "spool" / name).mkdir(exist_ok=True)
            spool, pid, log = self.root / "spool" / "%n", self.root / "slurmd-%n.pid", self.root / "log" / "slurmd-%n.log"
            node_lines = [f"NodeName={name} NodeHostname={name} NodeAddr={self.addresses[name]} Port={free_port()} "
                          f"CPUs=1 RealMemory={mem_mb // len(self.nodes)} State=UNKNOWN" for name in self.nodes]
            name = TWO_NODE_CLUSTER
        else:
            spool, pid, log = self.root / "spool", self.root / "slurmd.pid", self.root / "log" / "slurmd.log"
            node_lines = [f"NodeName={self.host} NodeAddr={self.addresses[self.host]} CPUs={os.cpu_count() or 1} RealMemory={mem_mb} "
                          "State=UNKNOWN"]
            name = "drafter-test"
        self.conf.write_text("\n".join([
            f"ClusterName={name}", f"SlurmctldHost={self.host}(127.0.0.1)", f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={pid}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={log}",
            "AuthType=auth/munge", "MpiDefault=none", "ReturnToService=2", "MinJobAge=3600", "KillWait=5",
            *node_lines,
            f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP", ""]))

    def pid_files(self) -> list[Path]:
        slurmd = [self.root / f"slurmd-{n}.pid" for n in self.nodes] if self.multi else [self.root / "slurmd.pid"]
        return [*slurmd, self.root / "slurmctld.pid"]

    def start(self, timeout: float = 60.0) -> None:
        self.write_conf()
        if not _munged_running():
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            started = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], capture_output=True, text=True)
            if started.returncode != 0 and not _munged_running():  # not just another test process that won the race
                raise RuntimeError(f"munged did not start: {started.stderr.strip()}")
        subprocess.run(["slurmctld", "-f", str(self.conf)], check=True, env=self.env)
        if self.multi:
            for name in self.nodes:  # each node its own host name, as job steps on it will see
                subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname {name} && exec slurmd -f "$SLURM_CONF" -N {name}'],
                               check=True, env=self.env)
        else:
            subprocess.run(["slurmd", "-f", str(self.conf)], check=True, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.tool("sinfo", "-h", "-N", "-o", "%N %T")
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if out.returncode == 0 and set(states) == set(self.nodes) and set(states.values()) == {"idle"}:
                return
            time.sleep(1)
        raise RuntimeError(f"the test Slurm nodes {self.nodes} did not come up in {timeout:.0f} s; logs in "
                           f"{self.root / 'log'}")

    def wait(self, job_ids: list[str], timeout: float = 900.0) -> None:
        """Until none of ``job_ids`` is queued or running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.tool("squeue", "-h", "-o", "%i", "-j", ",".join(job_ids))
            if not out.stdout.strip():
                return
            time.sleep(2)
        raise TimeoutError(f"jobs {job_ids} still queued after {timeout:.0f} s; logs in {self.root}")

    def stop(self) -> None:
        self.tool("scancel", "--full", "-u", "root")
        deadline = time.monotonic() + 30  # the jobs' processes end under their slurmd before it is stopped
        while self.tool("squeue", "-h", "-o", "%i").stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid_file in self.pid_files():
            if pid_file.is_file():
                subprocess.run(["kill", pid_file.read_text().strip()], capture_output=True)


def _munged_running() -> bool:
    return subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0


def _started(tmp_path_factory: pytest.TempPathFactory, name: str, nodes: tuple[str, ...] | None
             ) -> Iterator[SlurmCluster]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing or os.geteuid() != 0:
        why = f"Slurm binaries {missing} not installed" if missing else "not root (slurmd/munged need root)"
        skip_unless(False, why, "DRAFTER_REQUIRE_SLURM", "`apt-get install -y slurm-wlm munge` as root (.ci/run does)")
    cluster = SlurmCluster(tmp_path_factory.mktemp(name), nodes)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The one-node cluster, started once per session (module fixtures use it inside ``cluster.active()``)."""
    yield from _started(tmp_path_factory, "slurm", None)


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """The two-node cluster (nodeA, nodeB), started once per session."""
    yield from _started(tmp_path_factory, "slurm-nodes", TWO_NODES)


@pytest.fixture
def slurm_cluster(slurm_one_node: SlurmCluster) -> Iterator[SlurmCluster]:
    """The one-node cluster, with ``SLURM_CONF`` pointing at it for this test."""
    with slurm_one_node.active() as cluster:
        yield cluster


@pytest.fixture
def two_node_slurm(slurm_two_nodes: SlurmCluster) -> Iterator[SlurmCluster]:
    """The two-node cluster, with ``SLURM_CONF`` pointing at it for this test."""
    with slurm_two_nodes.active() as cluster:
        yield cluster
