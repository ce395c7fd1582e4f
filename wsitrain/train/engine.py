"""Build the model and wrap it in the SFT engine; device choice; seeds and deterministic mode."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from wsitrain.config import EngineConfig, ModelConfig
from wsitrain.errors import ConfigError
from wsitrain.host_need import ranks_per_node
from wsitrain.models import build
from wsitrain.models.registry import is_imagenet
from wsitrain.models.weights import load_weights
from wsitrain.patch.encoders import file_has_lora
from wsitrain.patch.lora import add_lora
from wsitrain.sft import SFT
from wsitrain.sft.execution.spill import SpillFiles
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.calibration import device_name, run_time_model
from wsitrain.sft.planning.placement import image_on_disk, place_host
from wsitrain.spill_dir import check_spill_dir, default_host_memory, spill_folder
from wsitrain.train.distributed import DistInfo


def resolve_device(name: str, dist: DistInfo | None = None) -> torch.device:
    """engine.device: auto (CUDA if present), cpu, or cuda (one GPU per rank under torchrun)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(["engine.device: 'cuda' but no CUDA GPU is visible; use device: auto or cpu"])
        return torch.device("cuda", dist.local_rank if dist is not None else 0)
    return torch.device("cpu")


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; deterministic mode also asks torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace for reproducible matmuls; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def build_model(
    m: ModelConfig, num_classes: int, class_names: Sequence[str] | None = None, with_weights: bool = True
) -> nn.Module:
    """The run's model; ``class_names`` (a classification's) place an attention head's instance stream.
    ``with_weights=False``: ``model.weights`` is not read (a plan's shapes, or a checkpoint's state loaded after)."""
    weights = m.weights if with_weights else None
    lora = m.lora_spec()
    # a LoRA run's weights hold the adapters: loaded once they are in place (wsitrain.patch.lora)
    adapted = lora is not None and weights is not None and not is_imagenet(weights) and file_has_lora(weights)
    model = build(
        m.name, num_classes, weights=None if adapted else weights, pool=m.pool, freeze_bn=m.freeze_bn,
        attention=m.attention.spec(class_names),
        freeze=m.freeze_spec(),
        mask_pool=m.mask_pool, topk=m.topk, map_norm=m.map_norm, bn_stats=m.bn_stats, patch=m.patch,
    )
    if lora is not None:
        add_lora(model, lora, m.freeze_spec())
        if adapted:
            assert weights is not None
            load_weights(model, weights)
    return model


def batchnorm_note(model: nn.Module, freeze_bn: bool) -> str:
    """One log line saying what happens to BatchNorm, since it changes what training does."""
    norms = [mod for mod in model.modules() if isinstance(mod, nn.modules.batchnorm._BatchNorm)]
    n = sum(mod.running_mean is not None for mod in norms)
    k = len(norms) - n
    # model.bn_stats / model.map_norm / model.attention.norm: slide keep no running statistics: neither frozen nor
    # running averages in prediction, always the slide's
    slide = (f"{k} without running statistics (model.bn_stats, model.map_norm or model.attention.norm: slide) "
             "normalise with each slide's own, in training and prediction, in extra sweeps")  # fmt: skip
    if n == 0:
        layers = " layer without" if k == 1 else " layers without"
        return f"BatchNorm: {slide.replace(' without', layers, 1)}" if k else "BatchNorm: the model has none"
    slide = f"; {slide}" if k else ""
    if freeze_bn:
        return (
            f"BatchNorm: {n} layers frozen (running statistics fixed, affine trained; model.freeze_bn: false to change)"
            + slide
        )
    return (
        f"BatchNorm: {n} layers in training mode (statistics of the whole batch; tiled segments holding them "
        "run extra sweeps over their tiles)" + slide
    )


def wrap_engine(
    model: nn.Module,
    engine: EngineConfig,
    device: torch.device,
    budget_bytes: int,
    optimizer: str | None,
    one_pass: bool = True,
    low_precision: bool = False,
) -> SFT:
    """The SFT engine around ``model`` (moved to ``device``), planning every input shape within the run's one budget.

    ``budget_bytes`` is resolved once per run (``wsitrain.gpus.run_budget``), never re-detected per shape. The
    time model is the device's calibration (``wsitrain doctor --calibrate``) when there is one, else on a GPU with a
    speed preset the simulated clock's constants for it and the run's precision (``low_precision``: bf16 or fp16), as
    ``wsitrain plan --gpu`` plans with (``run_time_model``). ``one_pass``: the
    run's loss lets the last tiled segment back-propagate in forward where the head allows it (``one_pass_loss``).
    """
    return SFT(
        model.to(device),
        memory_budget=budget_bytes,
        tile_size=engine.tile_size,
        checkpoints=engine.checkpoints,
        optimizer=optimizer,
        time_model=run_time_model(device.type, device_name(device), low_precision)[0],
        host_memory=host_memory_per_rank(engine),
        spill_dir=str(spill_folder(engine.spill_dir)),
        one_pass=one_pass and engine.one_pass,
        fold_bn=engine.fold_bn,
    )


def one_pass_loss(n_outputs: int, softmax_loss: bool) -> bool:
    """Does the run's loss give the pooled gradient the direction a one-pass segment back-propagates in forward
    (``wsitrain/sft/ops/linear_head.py``)? One output under any loss; two under a softmax loss (classification's
    cross-entropy, weighted or not). Two outputs under another loss (MSE on logits, two regression targets or
    labels) would recompute every step after the one pass: the engine is told not to try."""
    return n_outputs == 1 or (n_outputs == 2 and softmax_loss)


def check_spill_room(engine: EngineConfig, plans: list[Plan], slides_on_disk: int = 0) -> None:
    """Before anything is written: engine.spill_dir can take what the run's largest plan spills past
    engine.host_memory, for every rank on this node (exit 2 naming the key and folder otherwise).
    ``slides_on_disk``: decoded slides the loader holds at once in spill files (``slide_spill``; 2 with prefetch)."""
    host = host_memory_per_rank(engine)
    spill = max((executor_spill(place_host(p, host), slides_on_disk) for p in plans), default=0)
    check_spill_dir(engine.spill_dir, spill, ranks_per_node())


def executor_spill(plan: Plan, slides_on_disk: int = 0) -> int:
    """Bytes written to engine.spill_dir in a step of ``plan``: spilled checkpoints after the image, with their
    gradient buffers, and ``slides_on_disk`` decoded images where the plan put the image on disk."""
    image = plan.segments[0].checkpoint_bytes if image_on_disk(plan) else 0
    return slides_on_disk * image + sum(2 * s.checkpoint_bytes for s in plan.segments if s.start and s.spilled)


def slide_spill(engine: EngineConfig, plans: list[Plan], stream: bool) -> SpillFiles | None:
    """Where whole slides are decoded: None (RAM) when they are streamed (data.stream_tiles) or every plan keeps
    the image within engine.host_memory; else memory-mapped files in engine.spill_dir (augmented copies, made by
    flips and quarter turns, still live in RAM: stream the slide to keep those out too)."""
    if stream:
        return None
    host = host_memory_per_rank(engine)
    if not any(image_on_disk(place_host(p, host)) for p in plans):
        return None
    return SpillFiles(spill_folder(engine.spill_dir))


def host_memory_per_rank(engine: EngineConfig) -> int:
    """engine.host_memory, or the node's RAM divided among its ranks (torchrun's LOCAL_WORLD_SIZE)."""
    b = engine.host_memory_bytes
    return b if b is not None else default_host_memory(ranks_per_node())
