"""The shipped Slurm scripts (scripts/slurm/) on a real Slurm: a private cluster of two "nodes" on this machine
(tests/slurm_cluster.py) runs `srun torchrun ... wsitrain fit` on one node with two ranks, on two nodes with one rank
each (c10d rendezvous at the head node's address), and a job stopped by Slurm's signal mid-epoch that requeues itself
and resumes from last.pt to exactly the weights of the uninterrupted run (CPU, gloo).

Skipped, saying why, without Slurm and munge (Debian's slurm-wlm and munge; .ci/run installs them) or without root.
The file takes 100 s on this project's 2-core machine (measured: `pytest tests/test_slurm_real.py`, 102 s wall).
"""

from __future__ import annotations

import csv
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
import torch
from slurm_cluster import LocalSlurm, missing_reason

from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts" / "slurm"
HOOK = Path(__file__).resolve().parent / "slurm_hook"
# A job here takes 20-25 s, the requeued one 51 s with both attempts (measured, --durations, 2-core machine); 240 s
# fails a hung job, with its log, well before CI would.
JOB_TIMEOUT_S = 240.0
PAUSE_AFTER_STEP = 1  # the requeue test's signal comes after this optimizer step; the ranks stop after the next



@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    if not (Path(sys.prefix) / "bin" / "torchrun").is_file():
        pytest.skip(f"no torchrun in {sys.prefix}/bin: run the tests from the virtual environment (make test)")
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 synthetic slides of 256 px, 6 to train (3 a rank: 3 optimizer steps in the epoch), 2 to validate."""
    root = tmp_path_factory.mktemp("slurm-data")
    rows = list(csv.DictReader(write_synthetic_dataset(root / "slides", n=8, size=256, seed=0).open()))
    with (root / "labels.csv").open("w") as f:
        f.write("slide,label,split\n")
        for i, r in enumerate(rows):
            f.write(f"{r['slide']},{r['label']},{'val' if i >= 6 else 'train'}\n")
    path = root / "fit.yaml"
    path.write_text(
        f"seed: 1\n"
        f"data: {{labels: {root / 'labels.csv'}, slides_dir: {root / 'slides'}, region: whole,\n"
        f"       augment: {{flips: false, rot90: false}}}}\n"
        f"model: {{name: tiny}}\n"
        f"engine: {{memory_budget: 1GiB, tile_size: 128, device: cpu}}\n"
        f"train: {{epochs: 1, optimizer: sgd, lr: 0.05}}\n"
        f"distributed: {{backend: gloo}}\n"
        f"log: {{dir: {root / 'runs'}, tiles: 'off'}}\n"
    )
    return path


def job_env(config: Path, run_name: str, **extra: str) -> dict[str, str]:
    return {
        "WSITRAIN_CONFIG": str(config),
        "WSITRAIN_VENV": sys.prefix,  # this interpreter's virtual environment: its torchrun, its wsitrain
        "WSITRAIN_RUN_NAME": run_name,
        # the checkout under test, whatever the venv's editable install points at
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # one thread a rank: 2 ranks on 2 cores, and the same float sums whatever the number of ranks on a node
        "OMP_NUM_THREADS": "1",
        # a port free now, not the scripts' 29500 + job id: this private cluster numbers its jobs from 1 like any
        # other, so that port may be another local cluster's or job's (two clusters at once once failed a CI run so)
        "WSITRAIN_RDZV_PORT": str(_free_port()),
        **extra,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit(cluster: LocalSlurm, tmp: Path, script: str, env: dict[str, str], *sbatch: str) -> tuple[str, Path]:
    job = cluster.sbatch(SCRIPTS / script, "--job-name", env["WSITRAIN_RUN_NAME"], *sbatch, cwd=tmp, env=env)
    return job, tmp / f"slurm-{env['WSITRAIN_RUN_NAME']}-{job}.out"


def finished(cluster: LocalSlurm, job: str, log: Path) -> dict[str, str]:
    info = cluster.wait_done(job, JOB_TIMEOUT_S, log)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), f"{info}\n{log.read_text()}"
    return info


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run / "last.pt")["model"]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def one_node(cluster: LocalSlurm, config: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """fit-one-node.sbatch with two ranks: the uninterrupted run the other tests compare with; (run, job log)."""
    tmp = tmp_path_factory.mktemp("one-node")
    job, log = submit(cluster, tmp, "fit-one-node.sbatch", job_env(config, "one-node", WSITRAIN_NPROC_PER_NODE="2"))
    info = finished(cluster, job, log)
    assert info["NumNodes"] == "1", info
    return config.parent / "runs" / "one-node", log.read_text()


@pytest.mark.heavy  # a private cluster's jobs: 13-18 s each (measured); CI runs them (`make test-heavy`)
def test_one_node_two_ranks(one_node: tuple[Path, str]) -> None:
    run, out = one_node
    assert ": 1 node x 2 rank(s), config" in out and "; 2 ranks" in out, out  # the script's line, then wsitrain's
    assert load_checkpoint(run / "last.pt")["global_step"] == 3  # 6 slides over 2 ranks; one process takes 6 steps
    assert json.loads((run / "summary.json").read_text())["epochs"] == 1


@pytest.mark.heavy
def test_two_nodes_one_rank_each(
    cluster: LocalSlurm, config: Path, one_node: tuple[Path, str], tmp_path: Path
) -> None:
    job, log = submit(cluster, tmp_path, "fit-multi-node.sbatch", job_env(config, "two-nodes"))
    info = finished(cluster, job, log)
    out = log.read_text()
    assert info["NumNodes"] == "2" and info["NodeList"] == "n[1-2]", info
    # the head node's address (NodeAddr), not its Slurm name: "n1" resolves nowhere
    assert "2 node(s) x 1 rank(s), rendezvous localhost:" in out, out
    run = config.parent / "runs" / "two-nodes"
    assert load_checkpoint(run / "last.pt")["global_step"] == 3  # world size 2 again
    # the same two ranks' sums, whichever node each ran on: the same weights, bit for bit
    assert_bitwise_equal(weights(run), weights(one_node[0]))


@pytest.mark.heavy  # 30-50 s on 2 cores (measured 2026-11-27); CI runs it, `make test` does not
def test_signal_mid_epoch_requeues_and_resumes_to_the_same_weights(
    cluster: LocalSlurm, config: Path, one_node: tuple[Path, str], tmp_path: Path
) -> None:
    # Two nodes, one rank each: srun forwards the signal to both torchruns, and the requeued job meets again at the
    # head node's rendezvous.
    paused = tmp_path / "paused"
    env = job_env(config, "requeued", WSITRAIN_TEST_PAUSE_FILE=str(paused),
                  WSITRAIN_TEST_PAUSE_AFTER_STEP=str(PAUSE_AFTER_STEP))  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(HOOK), env["PYTHONPATH"]])
    job, log = submit(cluster, tmp_path, "fit-requeue.sbatch", env, "--nodes=2")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not paused.exists():  # rank 0 holds after step 1 until the signal reaches it (slurm_hook)
        assert cluster.is_queued(job), f"job ended before step {PAUSE_AFTER_STEP}:\n{log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    # What `--signal=B:USR1@120` does before the time limit: USR1 to the batch shell only.
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    info = finished(cluster, job, log)
    assert info["Restarts"] == "1" and info["NodeList"] == "n[1-2]", info

    out = log.read_text()  # --open-mode=append: both attempts
    assert "got USR1" in out and f"requeueing job {job}" in out, out
    stop_step = PAUSE_AFTER_STEP + 1
    assert f"preempted (SIGUSR1) at epoch 1 step {stop_step};" in out, out
    assert "--resume auto: continuing" in out, out
    run = config.parent / "runs" / "requeued"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [stop_step]  # mid-epoch: 3 steps in the epoch
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]  # rank 0's slides, none twice
    assert json.loads((run / "job.json").read_text())["job"] == job
    assert load_checkpoint(run / "last.pt")["global_step"] == 3
    assert_bitwise_equal(weights(run), weights(one_node[0]))


def test_the_skip_reason_names_the_packages_and_who_installs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name, path=None: None)
    reason = missing_reason()
    assert reason is not None and "munged, slurmctld, slurmd" in reason
    assert "`apt-get install slurm-wlm munge`" in reason and ".ci/run installs them" in reason
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name, path=None: f"/usr/sbin/{name}")
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    assert (missing_reason() or "").startswith("needs root")
