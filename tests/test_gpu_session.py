"""benchmarks/gpu_session.py on a CPU: the GPU kit's code path (cases, OOM guard, profiler, breakdown, tables)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script


def _kit():
    return load_script("gpu_session")


def test_classify_names_the_parts_of_a_step() -> None:
    k = _kit()
    assert k.classify("aten::convolution", [k.FORWARD]) == "conv forward"
    assert k.classify("aten::convolution", [k.RECOMPUTE, k.BACKWARD]) == "recompute"
    assert k.classify("aten::convolution_backward", [k.TILE_BACKWARD, k.BACKWARD]) == "conv backward"
    assert k.classify("aten::copy_", [k.STAGE, k.FORWARD]) == "host staging"
    assert k.classify("aten::copy_", [k.JOIN, k.FORWARD]) == "joins"
    assert k.classify("aten::add_", [k.OVERLAP_ADD, k.BACKWARD]) == "overlap-adds"
    assert k.classify("aten::_foreach_mul_", [k.OPTIMIZER]) == "optimizer"
    assert k.classify("aten::constant_pad_nd", [k.FORWARD]) == "pads"
    assert k.classify("aten::slice", [k.FORWARD]) == "crops"
    assert k.classify("aten::clone", [k.FORWARD]) == "copies"
    assert k._span_and_union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == (6.0, 4.0)  # idle: 6 - 4 = 2


@pytest.fixture(scope="module")
def quick_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One quick CPU session with ``--fold-compare`` on a model with BatchNorm, which both tests below read: each ran
    a session of its own before (12-13 s each, measured); the fold comparison's rows come after the session's own."""
    out = tmp_path_factory.mktemp("gpu_session")
    code = _kit().main(["--device", "cpu", "--size", "128", "--quick", "--models", "tiny_bn", "--budget", "13MiB",
                        "--out", str(out), "--fold-compare"])  # fmt: skip
    assert code == 0
    return out


def test_cpu_quick_session_writes_the_tables(quick_session: Path) -> None:
    k, tmp_path = _kit(), quick_session
    lines = [json.loads(x) for x in (tmp_path / "gpu_session.jsonl").read_text().splitlines()]
    rows = [x for x in lines if "breakdown" not in x]
    prof = next(x["breakdown"] for x in lines if "breakdown" in x)
    assert [r["run"] for r in rows][:2] == ["plain, 4 patches of 64 px, channels_last", "plain, one image, NCHW"]
    assert all(r["status"] == "ok" for r in rows), rows
    capped = [r for r in rows if "capped" in r["run"]]
    assert capped and all("tiled" in r["plan"] for r in capped)  # the cap makes it tile
    # what a replay needs to run the card's own step (fit_clock.py): its target, torch, the plan's optimizer, fallbacks
    sft_rows = [r for r in rows if "plan" in r]
    assert sft_rows and all(r["plan_optimizer"] == "adamw" and r["target"]["kind"] == "cpu" and r["torch"]
                            and r["one_pass_fallbacks"] == 0 for r in sft_rows)  # fmt: skip
    # the caching allocator's calls per step (CUDA; none on a CPU)
    assert all(r["allocator_per_step"] == dict.fromkeys(("num_alloc_retries", "num_device_alloc",
                                                         "num_device_free"), 0.0) for r in rows)  # fmt: skip
    secs = prof["seconds"]
    assert set(secs) == set(k.CATEGORIES)
    assert secs["conv forward"] > 0 and secs["recompute"] > 0 and secs["conv backward"] > 0
    assert secs["joins"] > 0 and secs["optimizer"] > 0 and secs["overlap-adds"] > 0
    assert prof["span_s"] >= prof["busy_s"] > 0
    md = (tmp_path / "gpu_session.md").read_text()
    assert "| recompute |" in md and "idle between kernels" in md and "*Measured* on cpu" in md


@pytest.mark.parametrize("budget", ["1KiB"])
def test_a_case_that_cannot_fit_is_a_row_not_a_crash(tmp_path: Path, budget: str) -> None:
    k = _kit()
    import torch

    row = k.run_case(k.Case("tiny", "SFT capped", True, budget=budget), torch.device("cpu"), 128, 64, 1, 1.0)
    assert row["status"] in ("oom", "error") and "fit" in row["note"]


def _event(name: str, start: float, end: float, device: str = "DeviceType.CPU", parent=None, kernels=(),
           annotation: bool = False, shapes=()):  # fmt: skip
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           cpu_parent=parent, kernels=list(kernels), is_user_annotation=annotation,
                           self_cpu_time_total=end - start, input_shapes=list(shapes))  # fmt: skip


def test_device_breakdown_charges_kernels_to_their_launchers_and_skips_annotations() -> None:
    """On a GPU the profiler links each kernel to the operator that launched it (``kernels``) and copies the
    record_function ranges onto the device timeline (user annotations): the kernels are charged to their
    operators' parts, the annotations are neither kernels nor busy time (they made the first H200 profile's parts
    sum to twice its span)."""
    from types import SimpleNamespace

    k = _kit()
    rec = _event(k.RECOMPUTE, 0, 100)
    bwd = _event(k.BACKWARD, 0, 100)
    rec.cpu_parent = bwd
    conv = _event("aten::cudnn_convolution", 10, 20, parent=rec, shapes=[[1, 8, 9, 9], [8, 8, 1, 1]],
                  kernels=[SimpleNamespace(name="sm90_xmma_fprop", duration=30.0)])  # fmt: skip
    grad = _event("aten::convolution_backward", 30, 40, parent=bwd,
                  kernels=[SimpleNamespace(name="dgrad", duration=20.0)])  # fmt: skip
    events = [
        bwd, rec, conv, grad,
        _event("sm90_xmma_fprop", 100, 130, device="DeviceType.CUDA"),
        _event("dgrad", 140, 160, device="DeviceType.CUDA"),
        _event(k.BACKWARD, 100, 200, device="DeviceType.CUDA", annotation=True),
    ]  # fmt: skip
    out = k.breakdown(events, device_timeline=True)
    assert out["seconds"]["recompute"] == 30e-6 and out["seconds"]["conv backward"] == 20e-6
    assert sum(out["seconds"].values()) == 30e-6 + 20e-6 + 10e-6  # the idle gap 130..140 and nothing else
    assert out["span_s"] == 60e-6 and out["busy_s"] == 50e-6 and out["intervals"] == 2
    assert out["kernels"][0] == {"part": "recompute", "op": "aten::cudnn_convolution", "kernel": "sm90_xmma_fprop",
                                 "seconds": 30e-6, "calls": 1}  # fmt: skip
    assert out["convolutions"][0]["op_shapes"] == "aten::cudnn_convolution [[1, 8, 9, 9], [8, 8, 1, 1]]"


def test_a_tiles_matrix_products_count_as_its_convolutions() -> None:
    """A tile's 1x1 layers run as matrix products (ops/pointwise_conv.py): their forward products are the
    convolutions' forward, the products autograd's backward runs their backward."""
    from types import SimpleNamespace

    k = _kit()
    tile = _event(k.TILE_BACKWARD, 0, 100, parent=_event(k.BACKWARD, 0, 100))
    fwd = _event("aten::mm", 10, 20, parent=tile, shapes=[[512, 128], [128, 149769]],
                 kernels=[SimpleNamespace(name="nvjet_tst", duration=30.0)])  # fmt: skip
    node = _event("autograd::engine::evaluate_function: MmBackward0", 30, 60, parent=tile)
    bwd = _event("aten::mm", 30, 40, parent=node, kernels=[SimpleNamespace(name="cutlass_gemm", duration=20.0)])
    out = k.breakdown([tile, fwd, node, bwd], device_timeline=True)
    assert out["seconds"]["conv forward"] == 30e-6 and out["seconds"]["conv backward"] == 20e-6
    assert {r["op_shapes"] for r in out["convolutions"]} == {"aten::mm [[512, 128], [128, 149769]]", "aten::mm []"}


def test_a_session_runs_what_matters_most_first() -> None:
    k = _kit()
    order = k.session_order(k.cases(["a", "b"], "1GiB", 4))
    names = [(type(x).__name__, x.case.model if isinstance(x, k.Profile) else x.model) for x in order]
    first_profile = names.index(("Profile", "a"))
    assert all(m == "a" for _, m in names[:first_profile])  # the first model's cases, then its profiles
    assert names[-1] == ("Case", "a") and order[-1].benchmark  # the benchmark case's minute-long first step last
    profiled = [x.case for x in order if isinstance(x, k.Profile)]
    assert profiled[0].budget and profiled[0].sft and profiled[0].time_model == "run"  # the capped step first


def test_profile_all_profiles_every_models_capped_and_plain_steps() -> None:
    """``--profile-all``: after each other model's cases, its capped SFT step and its plain NCHW step, no more."""
    k = _kit()
    order = k.session_order(k.cases(["a", "b", "c"], "1GiB", 4), profile_all=True)
    for model in ("b", "c"):
        profiled = [x.case for x in order if isinstance(x, k.Profile) and x.case.model == model]
        assert sorted((c.sft, bool(c.budget)) for c in profiled) == [(False, False), (True, True)]
        assert not any(c.patches or c.channels_last for c in profiled)
        last_case = max(i for i, x in enumerate(order)
                        if isinstance(x, k.Case) and x.model == model and not x.benchmark)  # fmt: skip
        assert all(order.index(k.Profile(c)) > last_case for c in profiled)  # after the model's own cases
    assert order[-1].benchmark
    plain = k.session_order(k.cases(["a", "b"], "1GiB", 4))
    assert not any(isinstance(x, k.Profile) and x.case.model == "b" for x in plain)


def test_fold_compare_runs_the_steps_without_the_fold_and_tables_them(quick_session: Path) -> None:
    """``--fold-compare`` (issue 57): the capped step once more without the BatchNorm fold and the copy-free tiles,
    the first model's uncapped step too; patch training with BatchNorm in training mode; the tables hold the share of
    patch training and a section with and without the fold."""
    k, tmp_path = _kit(), quick_session
    rows = [json.loads(x) for x in (tmp_path / "gpu_session.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "breakdown" not in r]
    assert all(r["status"] == "ok" for r in rows), rows
    off = [r for r in rows if r.get("fold_bn") is False]
    assert sorted(r["run"] for r in off) == sorted([
        f"SFT, capped at 13MiB, cudnn.benchmark off, {k.FOLD_OFF}", f"SFT, no budget (plans for the card), {k.FOLD_OFF}"
    ])  # fmt: skip
    assert all(not r["copy_free"] for r in off)
    assert all(r["copy_free"] for r in rows if r.get("fold_bn") and "plan" in r)
    patch = next(r for r in rows if r["patches"])
    assert patch["patch_bn_train"] and not any(r["patch_bn_train"] for r in rows if not r["patches"])
    md = (tmp_path / "gpu_session.md").read_text()
    assert "## With and without the BatchNorm fold" in md and "| share of patch training |" in md
    fold_lines = [x for x in md.split("## With and without")[1].splitlines() if x.startswith("| tiny_bn |")]
    assert len(fold_lines) == 4  # capped and uncapped, each without and with the fold
    assert k.cases(["vgg16"], "1GiB", 4, fold_compare=True) == k.cases(["vgg16"], "1GiB", 4)  # no BatchNorm: no rows
