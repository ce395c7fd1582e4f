"""A private Slurm cluster on this machine, for tests: munged, slurmctld and two slurmd (nodes n1 and n2, both on
localhost) with every file in one temporary folder, started in about a second and torn down on exit.

Nothing global is touched: munged gets its own key and socket, the daemons their own ports, state, spool, pid and log
files, and clients find the cluster through SLURM_CONF in ``LocalSlurm.env``. Needs root (slurmd starts job steps
as the submitting user) and Debian's ``slurm-wlm`` and ``munge`` packages; ``missing_reason()`` says when either is
absent. Written for Slurm 22.05 (Debian 12) and munge 0.5.15.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

PACKAGES = "slurm-wlm munge"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
NODES = ("n1", "n2")
# The daemons live in sbin, which a non-login shell's PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])
# Startup took 0.5-1 s here (measured: the test's cluster fixture on this 2-core machine); 30 s leaves room for a
# loaded CI machine and still fails a broken setup quickly.
READY_TIMEOUT_S = 30.0


def missing_reason() -> str | None:
    """Why a local cluster cannot run here, or None."""
    missing = [name for name in DAEMONS + CLIENTS if shutil.which(name, path=_SEARCH_PATH) is None]
    if missing:
        return (f"Slurm/munge not installed ({', '.join(missing)} not found): `apt-get install {PACKAGES}` "
                "(Debian packages; .ci/run installs them, `make test` never does)")
    if os.geteuid() != 0:
        return "needs root: slurmd must run as root to start job steps (CI runs the suite as root)"
    return None


def _free_ports(n: int) -> list[int]:
    """n ports the kernel has free now, held together so they differ."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    """``with LocalSlurm(tmp) as cluster:`` a running cluster with nodes n1 and n2 idle; stopped, its jobs and every
    process they left killed, on exit (failures included)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.munge_dir: Path | None = None  # made by the start, removed by stop()
        self._daemons: list[subprocess.Popen[bytes]] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment for clients (sbatch, squeue, ...) and the jobs they submit."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _SEARCH_PATH}

    # ---- start
    def __enter__(self) -> LocalSlurm:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _start(self) -> None:
        for sub in ("state", "log", *(f"spool/{n}" for n in NODES)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged wants every folder above its socket searchable by all, which pytest's (0700) are not: a folder of its
        # own in the system's temporary folder instead; the key readable by its owner only.
        self.munge_dir = munge = Path(tempfile.mkdtemp(prefix="wsitrain-munge-"))
        munge.chmod(0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = munge / "munge.socket"
        self._spawn("munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={munge / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                    f"--seed-file={munge / 'munged.seed'}")  # fmt: skip
        self._wait_for(socket_path.exists, "munged's socket", self.root / "log" / "munged-0.out")
        self.conf.write_text(self.slurm_conf(socket_path, *_free_ports(1 + len(NODES))))
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self._spawn("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self._wait_for(self._nodes_idle, f"nodes {', '.join(NODES)} idle in sinfo", self.root / "log" / "slurmctld.log")

    def slurm_conf(self, munge_socket: Path, ctld_port: int, *node_ports: int) -> str:
        d = self.root
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=localhost Port={p} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for n, p in zip(NODES, node_ports, strict=True)
        )
        return f"""\
# Written by tests/slurm_cluster.py: a throwaway cluster in {d}
ClusterName=wsitrain-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again only after its credential expires (default 120 s): 5 s here.
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/log/slurmctld.pid
SlurmdPidFile={d}/log/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
# No cgroups (a container may not offer them) and no accounting daemon.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
# The main scheduler every second (default 60 s): a requeued job starts as soon as it may, not up to a minute later.
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# SIGTERM to SIGKILL at cancel or time limit (default 30 s): teardown does not wait on a job that ignores SIGTERM.
KillWait=5
# srun's own ports are left to the kernel (ephemeral, free by construction), so no SrunPortRange.
# Both "nodes" are this machine and each offers all its CPUs.
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, *args: str) -> None:
        """Start a daemon in the foreground (-D / --foreground), as this process's child, its output in log/."""
        exe = shutil.which(name, path=_SEARCH_PATH)
        assert exe is not None, name
        with open(self.root / "log" / f"{name}-{len(self._daemons)}.out", "wb") as log:
            # own session: a Ctrl-C in the test's terminal goes to pytest, which then tears the cluster down
            self._daemons.append(subprocess.Popen([exe, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                  start_new_session=True))  # fmt: skip

    def _wait_for(self, ready: Callable[[], bool], what: str, log: Path) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready():
            for p in self._daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}:\n"
                                       f"{_tail(log)}")  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {READY_TIMEOUT_S:.0f} s:\n{_tail(log)}")
            time.sleep(0.1)

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    # ---- use
    def run(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """A Slurm client command's stdout; a failure raises with its stderr."""
        out = subprocess.run(list(args), env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {out.returncode}: {out.stderr.strip()}")
        return out.stdout

    def sbatch(self, script: Path, *args: str, cwd: Path, env: dict[str, str]) -> str:
        """Submit ``script`` (sbatch options in ``args`` go before it, as on the command line); the job id."""
        return self.run("sbatch", "--parsable", *args, str(script), cwd=cwd, env=env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, NodeList, ...); finished jobs are kept for
        MinJobAge (300 s by default)."""
        fields: dict[str, str] = {}
        for word in self.run("scontrol", "-o", "show", "job", job_id).split():
            key, _, value = word.partition("=")
            fields.setdefault(key, value)
        return fields

    def is_queued(self, job_id: str) -> bool:
        """Pending, running or completing (a requeued job stays queued under its id)."""
        return bool(self.run("squeue", "-h", "-j", job_id, "-o", "%i").strip())

    def wait_done(self, job_id: str, timeout_s: float, output: Path | None = None) -> dict[str, str]:
        """Wait until the job has left the queue; its final ``job()`` fields. Raises with the job's output on
        timeout."""
        deadline = time.monotonic() + timeout_s
        while self.is_queued(job_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still queued after {timeout_s:.0f} s: {self.job(job_id)}\n"
                                   f"{_tail(output) if output else ''}")  # fmt: skip
            time.sleep(0.2)
        return self.job(job_id)

    # ---- stop
    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill what the jobs left; safe to call at any stage of a start."""
        if self._daemons and self.conf.exists():
            try:
                ids = self.run("squeue", "-h", "-o", "%i").split()
                if ids:
                    self.run("scancel", *ids)
                deadline = time.monotonic() + 20.0  # KillWait (5 s) and the epilog's bookkeeping
                while ids and self.run("squeue", "-h", "-o", "%i").strip() and time.monotonic() < deadline:
                    time.sleep(0.2)
            except RuntimeError:
                pass  # slurmctld is already gone: the sweep below still ends the jobs' processes
        for p in reversed(self._daemons):  # slurmd before slurmctld before munged
            if p.poll() is None:
                p.terminate()
        for p in reversed(self._daemons):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._daemons.clear()
        self._kill_leftovers()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)

    def _kill_leftovers(self) -> None:
        """slurmstepd and job processes outlive a stopped slurmd (proctrack/linuxproc): kill, by pid, those started
        for this cluster, which all carry its SLURM_CONF in their environment."""
        marker = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                environ = (proc / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return f"({path}: {err})"
