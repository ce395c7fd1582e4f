"""Preemption-safe training: a signal mid-epoch writes last.pt at the last optimizer step and exits 75; the resumed
run ends with exactly the weights of an uninterrupted one, and metrics.jsonl has no step twice; `--resume auto`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from test_fit_train import fit, model_weights, read_jsonl, small_cfg, small_labels, synth_dir  # noqa: F401
from typer.testing import CliRunner

from wsitrain.errors import WsiTrainError
from wsitrain.report.runlog import epoch_curves, metrics_rows
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.preempt import (
    PREEMPTED_EXIT_CODE,
    Preempted,
    StopSignals,
    find_job_run,
    job_key,
    parse_signal,
    write_job_file,
)
from wsitrain.train.runfolder import drop_rows_after_step
from wsitrain.train.state import FitState


class SignalAfterSteps:
    """Sends ``sig`` to this process once ``n`` optimizer steps are done, as Slurm would (the handler only sets a
    flag; the loop stops at its next safe point, after step n + 1)."""

    def __init__(self, n: int, sig: signal.Signals) -> None:
        self.n, self.sig, self.sent = n, sig, False

    def on_step_end(self, state: FitState) -> None:
        if state.global_step >= self.n and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_mid_epoch_then_resume_gives_the_same_weights(
    synth_dir: Path, small_labels: Path, tmp_path: Path, sig: signal.Signals  # noqa: F811
) -> None:
    # 6 training slides an epoch, 2 epochs, accumulate 2: 6 steps; the signal after step 1 stops after step 2,
    # mid-epoch (slide 4 of 6); no checkpoint_every, so last.pt exists only because of the stop.
    train = {"epochs": 2, "accumulate": 2, "schedule": "cosine", "warmup_steps": 1, "stop_signal": "USR1"}
    full, _ = fit(small_cfg(synth_dir, small_labels, tmp_path, name="full", train=train))

    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="stopped", train=train)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with pytest.raises(Preempted) as info:
        fit(cfg, callbacks=[SignalAfterSteps(1, sig)])
    # the handlers the fit installed are gone again
    assert {s: signal.getsignal(s) for s in before} == before
    stopped = tmp_path / "stopped"
    err = info.value
    assert err.exit_code == PREEMPTED_EXIT_CODE
    assert err.message.startswith(f"preempted ({sig.name}) at epoch 1 step 2; resume with `wsitrain fit CONFIG "
                                  f"--resume {stopped}`")
    ck = load_checkpoint(stopped / "last.pt")
    assert (ck["epoch"], ck["next_index"], ck["global_step"]) == (0, 4, 2)
    assert len(ck["epoch_losses"]) == 4
    assert not (stopped / "summary.json").exists() and not (stopped / "best.pt").exists()
    assert [p.name for p in stopped.iterdir() if p.name.endswith(".tmp")] == []

    resumed, out = fit(cfg, resume=stopped)
    assert resumed == stopped and "resuming" in out
    # the resumed epoch's line counts the slides trained since the resume, and says so
    assert "epoch 1/2: train loss" in out and "2 slides since the resume at slide 5," in out, out
    a, b = model_weights(full / "last.pt"), model_weights(stopped / "last.pt")
    assert set(a) == set(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bitwise
    # the epoch's training loss covers all its slides (the 4 before the stop too): the same history
    ha, hb = load_checkpoint(full / "last.pt")["history"], load_checkpoint(stopped / "last.pt")["history"]
    assert [h["train_loss"] for h in hb] == pytest.approx([h["train_loss"] for h in ha], rel=1e-6)


def test_stop_on_an_epochs_last_step_resumes_into_validation(
    synth_dir: Path, small_labels: Path, tmp_path: Path  # noqa: F811
) -> None:
    train = {"epochs": 2, "accumulate": 3}  # 2 steps an epoch: the signal after step 1 stops at step 2, slide 6/6
    full, _ = fit(small_cfg(synth_dir, small_labels, tmp_path, name="full", train=train))
    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="stopped", train=train)
    with pytest.raises(Preempted, match="at epoch 1 step 2;"):
        fit(cfg, callbacks=[SignalAfterSteps(1, signal.SIGTERM)])
    ck = load_checkpoint(tmp_path / "stopped" / "last.pt")
    assert (ck["epoch"], ck["next_index"], ck["global_step"]) == (0, 6, 2)
    run, _ = fit(cfg, resume=tmp_path / "stopped")
    a, b = model_weights(full / "last.pt"), model_weights(run / "last.pt")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    val = [r["epoch"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "val"]
    assert val == [1, 2]


def test_resumed_metrics_have_no_step_twice(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:  # noqa: F811
    from test_fit_train import StopAfterSteps

    train = {"epochs": 2, "checkpoint_every": 3}
    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="killed", train=train, log={"tiles": "summary"})
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, callbacks=[StopAfterSteps(5)])  # a kill after step 5: last.pt is from step 3
    run = tmp_path / "killed"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    fit(cfg, resume=run)
    rows = read_jsonl(run / "metrics.jsonl")
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == list(range(1, 13))
    tile_steps = [r["step"] for r in read_jsonl(run / "tiles.jsonl")]
    assert tile_steps == list(range(1, 13))
    assert [r["step"] for r in rows if r["kind"] == "resume"] == [3]
    curves = epoch_curves(run)
    assert curves.epochs == [1, 2] and len(curves.train["loss"]) == 2


def test_drop_rows_after_step_and_the_reader_of_old_runs(tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    lines = ['{"kind": "train", "step": 1}', '{"kind": "train", "step": 2}', '{"kind": "train", "step": 3}',
             '{"kind": "oom_replan"}', '{"kind": "tra']  # a torn last line, as a kill leaves it
    log.write_text("\n".join(lines) + "\n")
    assert drop_rows_after_step(log, 2) == 2
    assert read_jsonl(log) == [{"kind": "train", "step": 1}, {"kind": "train", "step": 2}, {"kind": "oom_replan"}]
    assert drop_rows_after_step(log, 2) == 0 and drop_rows_after_step(tmp_path / "none.jsonl", 1) == 0
    # a run resumed by an older wsitrain kept the re-logged rows: the reader skips the superseded ones
    old = ['{"kind": "train", "step": 1}', '{"kind": "train", "step": 2}', '{"kind": "resume", "step": 1}',
           '{"kind": "train", "step": 2, "new": true}']
    log.write_text("\n".join(old) + "\n")
    assert [(r["kind"], r["step"]) for r in metrics_rows(tmp_path)] == [("train", 1), ("resume", 1), ("train", 2)]
    assert metrics_rows(tmp_path)[-1].get("new") is True


def test_stop_signals_restore_handlers_and_second_ctrl_c_interrupts() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    with StopSignals(parse_signal("USR2")) as s:
        assert signal.getsignal(signal.SIGUSR2) is not before
        os.kill(os.getpid(), signal.SIGUSR2)
        assert s.requested == "SIGUSR2"
        with pytest.raises(KeyboardInterrupt):
            s._handle(signal.SIGINT, None)  # a second Ctrl-C does not wait for the step to finish
    assert signal.getsignal(signal.SIGUSR2) is before


def test_bad_stop_signal_is_a_config_error(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(ValidationError, match="stop_signal"):
        small_cfg(synth_dir, small_labels, tmp_path, train={"stop_signal": "NOPE"})
    with pytest.raises(ValidationError, match="stop_signal"):
        small_cfg(synth_dir, small_labels, tmp_path, train={"stop_signal": "KILL"})
    assert small_cfg(synth_dir, small_labels, tmp_path, train={"stop_signal": "usr1"}).train.stop_signal == "SIGUSR1"


def test_resume_auto_finds_this_jobs_run(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "train"}
    assert job_key(env) == "42"
    assert job_key({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}) == "40_3"
    assert find_job_run(tmp_path / "runs", env) is None
    for name, job in (("a", "41"), ("b", "42"), ("c", "42")):
        (tmp_path / "runs" / name).mkdir(parents=True)
        write_job_file(tmp_path / "runs" / name, {**env, "SLURM_JOB_ID": job})
    assert find_job_run(tmp_path / "runs", env) is None  # no checkpoint yet: a new run
    (tmp_path / "runs" / "b" / "last.pt").write_bytes(b"x")
    assert find_job_run(tmp_path / "runs", env) == tmp_path / "runs" / "b"
    with pytest.raises(WsiTrainError, match="not inside a Slurm job"):
        find_job_run(tmp_path / "runs", {})


def test_resume_auto_end_to_end(
    synth_dir: Path, small_labels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="job", train={"epochs": 1})
    with pytest.raises(Preempted):
        fit(cfg, callbacks=[SignalAfterSteps(1, signal.SIGTERM)], resume=Path("auto"))
    assert (tmp_path / "job" / "job.json").is_file()
    run, out = fit(cfg, resume=Path("auto"))
    assert run == tmp_path / "job" and "started by this job" in out
    assert load_checkpoint(run / "last.pt")["global_step"] == 6


def test_cli_preempted_exit_code_and_message(
    synth_dir: Path, small_labels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from wsitrain import cli
    from wsitrain.train import recipe

    def stop_at_once(self: recipe.FitRecipe) -> None:  # the stop path of train(), without training
        raise Preempted("preempted (SIGTERM) at epoch 1 step 0; resume with `wsitrain fit CONFIG --resume X`")

    monkeypatch.setattr(recipe.FitRecipe, "train", stop_at_once)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        f"data: {{labels: {small_labels}, slides_dir: {synth_dir}, region: whole}}\n"
        f"model: {{name: tiny}}\nengine: {{device: cpu, memory_budget: 1GiB, tile_size: 128}}\n"
        f"log: {{dir: {tmp_path / 'runs'}}}\n"
    )
    res = CliRunner().invoke(cli.app, ["fit", str(cfg_path)])
    assert res.exit_code == PREEMPTED_EXIT_CODE, res.output
    assert "stopped: preempted (SIGTERM) at epoch 1 step 0" in res.output and "error" not in res.output
    # under torchrun every rank stops; only rank 0 says so (a Slurm log showed the line once per rank)
    monkeypatch.setenv("RANK", "1")
    res = CliRunner().invoke(cli.app, ["fit", str(cfg_path), "--name", "rank1"])
    assert res.exit_code == PREEMPTED_EXIT_CODE, res.output
    assert "stopped:" not in res.output and "resume with" not in res.output


# ---- logs for batch jobs


def test_global_options_after_the_command() -> None:
    from wsitrain.cli import hoist_global_options

    assert hoist_global_options(["fit", "--quiet", "c.yaml", "-v"]) == ["--quiet", "-v", "fit", "c.yaml"]
    assert hoist_global_options(["-q", "fit", "c.yaml"]) == ["-q", "fit", "c.yaml"]
    assert hoist_global_options(["fit", "c.yaml", "--", "-q"]) == ["fit", "c.yaml", "--", "-q"]


def test_plain_lines_when_not_a_terminal_and_quiet_keeps_epoch_lines(
    synth_dir: Path, small_labels: Path, tmp_path: Path  # noqa: F811
) -> None:
    import io

    from rich.console import Console

    from wsitrain.train.fit import run_fit

    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="plain", train={"epochs": 1}, log={"every": 2})
    buf = io.StringIO()  # a file, as a Slurm log: no live display, plain lines
    run_fit(cfg, console=Console(file=buf, width=300), quiet=False)
    out = buf.getvalue()
    steps = [line for line in out.splitlines() if " step " in line and line.startswith("epoch 1/1 slide")]
    assert len(steps) == 3 and "loss" in steps[0] and "tiles" in steps[0] and "peak RSS" in steps[0]
    assert "\x1b[" not in out and "engine plan for" in out
    assert any(line.startswith("epoch 1/1: train loss") and "6 slides" in line for line in out.splitlines())

    buf = io.StringIO()  # --quiet (brief): the epoch and validation lines only
    run_fit(cfg.model_copy(update={"name": "brief"}), console=Console(file=buf, width=300), quiet=True, brief=True)
    lines = [line for line in buf.getvalue().splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1/1", "epoch 1/1 validation"]
    assert "engine plan for" not in buf.getvalue() and "run folder:" not in buf.getvalue()


def test_cli_quiet_after_the_command_keeps_epoch_summaries(
    synth_dir: Path, small_labels: Path, tmp_path: Path  # noqa: F811
) -> None:
    from wsitrain import cli

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        f"name: q\ndata: {{labels: {small_labels}, slides_dir: {synth_dir}, region: whole}}\n"
        f"model: {{name: tiny}}\nengine: {{device: cpu, memory_budget: 1GiB, tile_size: 128}}\n"
        f"train: {{epochs: 1}}\nlog: {{dir: {tmp_path / 'runs'}}}\n"
    )
    res = CliRunner().invoke(cli.app, ["fit", "--quiet", str(cfg_path)])
    assert res.exit_code == 0, res.output
    assert "epoch 1/1: train loss" in res.output and "engine plan for" not in res.output
