"""Host checkpoints spilled to local disk (engine.spill_dir): bitwise the host-memory step, placed by a RAM budget,
nothing left behind.

On CPU "host" is the process's memory; ``host_checkpoints="always"`` runs the host staging code there, and a host
RAM budget too small for the checkpoints puts them in memory-mapped files instead (execution/spill.py).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from sft_models import MODELS, weighted_step

from wsitrain.models import build
from wsitrain.sft import SFT, plan
from wsitrain.sft.execution.spill import SPILL_PREFIX, SpillFiles
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.planning.placement import host_items, place_host

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


_step = weighted_step


def _mapped_spill_files() -> int:
    """Spill files this process still maps (unlinked files stay in /proc/self/maps until unmapped)."""
    return sum(SPILL_PREFIX in line for line in Path("/proc/self/maps").read_text().splitlines())


def _engine(model: torch.nn.Module, x: torch.Tensor, **kw: object) -> SFT:
    facts = annotate(ModelGraph(model), tuple(x.shape), torch.float64, torch.float64, True)
    cuts = [facts.name(i) for i in facts.candidates[1:-1]][::2]  # a few checkpoints after the image
    return SFT(model, tile_size=24, memory_budget="1GiB", host_checkpoints="always", checkpoints=cuts, **kw)


@pytest.mark.parametrize("name", ["vgg_chain", "resnet_basic"])
def test_spilled_checkpoints_are_bitwise_the_host_step(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(2, 3, 37, 46, dtype=torch.float64)  # odd sizes: ragged edge tiles
    in_ram = _engine(model, x)
    ref = _step(model, in_ram, x)
    p_ram = in_ram.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert p_ram.spill_bytes == 0 and len(host_items(p_ram)) >= 2
    # a budget holding the staging buffers only: every host checkpoint and its gradient buffer goes to disk
    spilled = _engine(model, x, host_memory=p_ram.staging_bytes + 1, spill_dir=str(tmp_path))
    got = _step(model, spilled, x)
    p = spilled.plan_for(tuple(x.shape), input_dtype=torch.float64)
    on_disk = [s for s in p.segments if s.checkpoint_home == "disk"]
    assert on_disk and p.spill_bytes == sum(host_items(p_ram).values()) and p.host_bytes == p.staging_bytes
    files = spilled._stager.spill
    assert isinstance(files, SpillFiles) and files.allocated >= p.spill_bytes  # checkpoints and gradients mapped
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1], ref[1], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got[2], ref[2])
    plain = _step(model, model, x)  # and exact against plain autograd on the same weights and input
    torch.testing.assert_close(got[0], plain[0], rtol=1e-10, atol=1e-11)
    for a, b in zip(got[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(got[2], plain[2], rtol=1e-10, atol=1e-11)
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as mapped
    gc.collect()
    assert _mapped_spill_files() == 0  # and unmapped once the step dropped them


def test_spill_files_vanish_on_failure(tmp_path: Path) -> None:
    """A step that fails mid-backward leaves no file in the folder and no mapping once its tensors are gone."""
    torch.manual_seed(0)
    model = MODELS["vgg_chain"]().double()
    x = torch.randn(1, 3, 30, 30, dtype=torch.float64)
    ref = _engine(model, x).plan_for(tuple(x.shape), input_dtype=torch.float64)
    sft = _engine(model, x, host_memory=ref.staging_bytes + 1, spill_dir=str(tmp_path))

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("failed mid-step")

    y = sft(x.clone().requires_grad_(True))
    assert _mapped_spill_files() > 0  # the forward's spilled checkpoints are mapped
    y.register_hook(boom)
    with pytest.raises(RuntimeError, match="failed mid-step"):
        y.sum().backward()
    del y
    gc.collect()
    assert list(tmp_path.iterdir()) == [] and _mapped_spill_files() == 0


def test_spill_files_hold_their_data(tmp_path: Path) -> None:
    files = SpillFiles(tmp_path)
    t = files.empty((2, 3, 5), torch.float32)
    z = files.zeros((4, 4), torch.float64)
    assert t.untyped_storage().filename is not None or t.is_shared()  # a mapping, not malloc'd memory
    t.copy_(torch.arange(30.0).view(2, 3, 5))
    assert torch.equal(t.sum(), torch.tensor(435.0)) and torch.equal(z, torch.zeros(4, 4, dtype=torch.float64))
    assert files.allocated == 30 * 4 + 16 * 8 and list(tmp_path.iterdir()) == []


def _vgg_plan(host_memory: int | None = None):
    with torch.device("meta"):
        m = build("vgg16", 2)
    # without one pass (planning/one_pass.py), whose single segment would leave no checkpoint after the image to place
    p = plan(m, (1, 3, 16384, 16384), "11GiB", device="cuda", host_checkpoints="always", tile_size=2048, one_pass=False)
    return p if host_memory is None else place_host(p, host_memory)


def test_placement_keeps_the_largest_in_ram_and_spills_the_rest() -> None:
    p = _vgg_plan()
    items = host_items(p)
    assert len(items) >= 2 and p.spill_bytes == 0 and p.host_budget_bytes is None
    big = max(items.values())
    # room for the largest item only: it stays, every other one spills
    placed = place_host(p, p.staging_bytes + big)
    homes = {s.index: s.checkpoint_home for s in placed.segments if s.index in items}
    largest = max(items, key=lambda k: items[k])
    assert homes[largest] == "host" and all(homes[k] == "disk" for k in items if k != largest)
    assert placed.host_bytes == p.staging_bytes + big and placed.spill_bytes == sum(items.values()) - big
    assert placed.host_bytes + placed.spill_bytes == p.host_bytes and placed.fits
    # room for the image only: the later checkpoint spills, and the segment before it writes its output there
    small = place_host(p, p.staging_bytes + items[0])
    later = [k for k in items if k]
    assert small.segments[0].checkpoint_home == "host" and all(small.segments[k].spilled for k in later)
    assert all(small.segments[k - 1].output_spilled for k in later)
    # everything fits: nothing spills; nothing but staging: everything does
    assert place_host(p, p.host_bytes).spill_bytes == 0
    assert place_host(p, p.staging_bytes).spill_bytes == sum(items.values())
    text, d = str(placed), placed.to_dict()
    assert "on disk" in text and "disk spill per rank" in text
    assert {s["checkpoint_home"] for s in d["segments"]} >= {"host", "disk"} and d["spill_bytes"] == placed.spill_bytes


def test_placement_refuses_a_budget_below_the_staging_buffers() -> None:
    p = _vgg_plan()
    placed = place_host(p, p.staging_bytes - 1)
    assert not placed.fits and any("host budget" in n and "engine.host_memory" in n for n in placed.notes)


# ---- the simulated device: host RAM and disk against the plan -------------------------------------------------
def _simulated(host_memory: int | None):
    from wsitrain.sft.simulate import simulate_step

    with torch.device("meta"):
        m = MODELS["vgg_chain"]()
    return simulate_step(m, (2, 3, 75, 98), "1GiB", input_dtype=torch.float32, tile_size=32,
                         host_checkpoints="always", host_memory=host_memory)  # fmt: skip


def test_simulated_host_peak_within_the_plan_with_checkpoints_on_disk() -> None:
    in_ram = _simulated(None)
    assert in_ram.disk_peak.bytes == 0 and in_ram.host_within_plan
    spilled = _simulated(in_ram.plan.staging_bytes + 1)  # room for the staging buffers only
    p = spilled.plan
    assert p.spill_bytes > 0 and p.host_bytes == p.staging_bytes
    # the step's live host RAM is the staging buffers (and the optimizer's step counters), within the plan
    assert spilled.host_within_plan and spilled.host_peak.bytes < in_ram.host_peak.bytes
    assert 0 < spilled.disk_peak.bytes <= p.spill_bytes and spilled.disk_within_plan
    # what left RAM is on disk: the image and every checkpoint with its gradient buffer, live at once at the peak
    assert spilled.disk_peak.bytes == p.spill_bytes


# ---- engine.spill_dir and engine.host_memory: checked before anything is written ------------------------------
def test_spill_dir_config_errors_name_the_key_and_path(write_yaml, tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from wsitrain.cli import app
    from wsitrain.config import load_config
    from wsitrain.errors import ConfigError

    missing = tmp_path / "nowhere"
    res = CliRunner().invoke(app, ["validate", str(write_yaml(f"engine: {{spill_dir: {missing}}}\n"))])
    assert res.exit_code == 2, res.output
    assert "engine.spill_dir" in res.output and "does not exist" in res.output and str(missing) in res.output
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(f"engine: {{spill_dir: {a_file}}}\n"), [])
    assert any("engine.spill_dir" in p and "is not a folder" in p for p in info.value.problems)
    monkeypatch.setattr("wsitrain.spill_dir.os.access", lambda *a: False)  # root may write anywhere: pretend not
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(f"engine: {{spill_dir: {tmp_path}}}\n"), [])
    assert any("engine.spill_dir" in p and f"{tmp_path} is not writable" in p for p in info.value.problems)
    monkeypatch.undo()
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml("engine: {host_memory: lots}\n"), [])
    assert any("engine.host_memory" in p for p in info.value.problems)
    cfg = load_config(write_yaml(f"engine: {{spill_dir: {tmp_path}, host_memory: 16GiB}}\n"), [])
    assert cfg.engine.host_memory_bytes == 16 * 2**30 and cfg.engine.spill_dir == str(tmp_path)


def test_too_little_free_space_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch) -> None:
    import shutil

    from wsitrain.config import EngineConfig
    from wsitrain.errors import WsiTrainError
    from wsitrain.train.engine import check_spill_room, executor_spill

    p = _vgg_plan()
    placed = place_host(p, p.staging_bytes + 1)  # the image and one checkpoint on disk: 4.75 GiB
    spills = executor_spill(placed)  # what the engine writes there: the checkpoint and its gradient, 4 GiB
    assert 0 < spills == placed.spill_bytes - host_items(p)[0]
    engine = EngineConfig(spill_dir=str(tmp_path), host_memory=p.staging_bytes + 1)
    usage = shutil._ntuple_diskusage
    monkeypatch.setattr("wsitrain.spill_dir.shutil.disk_usage", lambda _: usage(1 << 40, 0, spills - 1))
    with pytest.raises(WsiTrainError) as info:
        check_spill_room(engine, [p])
    msg = str(info.value)
    assert "engine.spill_dir" in msg and str(tmp_path) in msg and "free" in msg and "per rank" in msg
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the disk: room for one is not enough
    monkeypatch.setattr("wsitrain.spill_dir.shutil.disk_usage", lambda _: usage(1 << 40, 0, spills))
    with pytest.raises(WsiTrainError, match="x 2 ranks on this node"):
        check_spill_room(engine, [p])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_spill_room(engine, [p])  # room for one rank's spill
    check_spill_room(EngineConfig(spill_dir=str(tmp_path), host_memory=p.host_bytes), [p])  # nothing spills


def test_host_need_counts_spilled_checkpoints_on_disk_not_in_ram() -> None:
    from wsitrain.host_need import host_need

    p = _vgg_plan()
    later = sum(v for k, v in host_items(p).items() if k)  # checkpoints after the image, with gradient buffers
    ram = host_need(p, 0, 0, "cuda")
    spilled = host_need(place_host(p, p.staging_bytes + 1), 0, 0, "cuda")
    assert ram.plan == later > 0 and spilled.plan == 0 and spilled.staging == ram.staging


def test_a_whole_slide_decodes_into_a_spill_file_bitwise(tmp_path: Path) -> None:
    """Streaming off and the image past engine.host_memory: the loader decodes the slide into engine.spill_dir."""
    from wsitrain.slides.dataset import SlideDataset, SlideRecord
    from wsitrain.slides.stream import read_slide_region
    from wsitrain.slides.synth import write_synthetic_slide

    path = write_synthetic_slide(tmp_path / "s.svs", size=640, positive=True, seed=3)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    files = SpillFiles(spill_dir)
    kw = {"mask_background": True, "pad_multiple": 32, "read_threads": 2}
    ram = read_slide_region(path, **kw).image
    on_disk = read_slide_region(path, allocator=files, **kw).image
    assert torch.equal(ram, on_disk) and files.allocated == ram.numel() > 0
    assert _mapped_spill_files() == 1 and list(spill_dir.iterdir()) == []  # mapped, already unlinked
    ds = SlideDataset([SlideRecord(slide_id="s", path=path, label=1, label_name="tumor")], kw, None, 0, spill=files)
    assert torch.equal(ds[0][0], ram) and files.allocated == 2 * ram.numel()
    del on_disk, ds
    gc.collect()
    assert _mapped_spill_files() == 0


def test_fit_spills_whole_slides_only_where_the_plan_puts_the_image_on_disk(tmp_path: Path) -> None:
    from wsitrain.config import EngineConfig
    from wsitrain.train.engine import executor_spill, image_on_disk, slide_spill

    p = _vgg_plan()
    image = host_items(p)[0]  # the image, segment 0's host input
    tight = EngineConfig(spill_dir=str(tmp_path), host_memory=p.staging_bytes + 1)
    roomy = EngineConfig(spill_dir=str(tmp_path), host_memory=p.host_bytes)
    assert isinstance(slide_spill(tight, [p], stream=False), SpillFiles)
    assert slide_spill(tight, [p], stream=True) is None  # streamed: no whole slide to hold
    assert slide_spill(roomy, [p], stream=False) is None  # the image fits engine.host_memory
    placed = place_host(p, p.staging_bytes + 1)
    assert image_on_disk(placed) and not image_on_disk(p)
    assert executor_spill(placed, 2) == executor_spill(placed) + 2 * image  # the slide and the one read ahead


def test_preflight_counts_whole_slides_on_disk_not_in_ram() -> None:
    """Streaming off, the image placed on disk: the preflight's host need keeps one augmented copy, not two slides."""
    from wsitrain.config import WsiTrainConfig
    from wsitrain.preflight import BucketPlan, host_bytes_needed

    p = _vgg_plan()
    image = host_items(p)[0]
    cfg = WsiTrainConfig()
    ram = host_bytes_needed(cfg, BucketPlan((16384, 16384), ("s",), p), "cuda")
    disk = host_bytes_needed(cfg, BucketPlan((16384, 16384), ("s",), place_host(p, p.staging_bytes + 1)), "cuda")
    assert ram - disk >= image  # two slides (trained, read ahead) in RAM against one augmented copy
    plain = cfg.model_copy(update={"data": cfg.data.model_copy(update={"augment": cfg.data.augment.model_copy(
        update={"flips": False, "rot90": False})})})  # fmt: skip
    assert host_bytes_needed(plain, BucketPlan((16384, 16384), ("s",), place_host(p, p.staging_bytes + 1)), "cuda") \
        == disk - image  # fmt: skip
