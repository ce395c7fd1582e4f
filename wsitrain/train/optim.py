"""Optimizers (SGD, Adam, AdamW), learning-rate schedules (constant, cosine, warmup) and losses."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from wsitrain.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "warmup")
LOSSES = ("cross_entropy", "mse")


ParamGroups = list[dict[str, Any]]


def layer_ids(model: torch.nn.Module) -> tuple[dict[str, int], int]:
    """Each trunk parameter's layer for layer-wise learning-rate decay, and the number of blocks n: 0 for everything
    of the trunk (or patch encoder) before its first block (patch and position embeddings, a stem), i + 1 for block i
    (wsitrain.patch.blocks), n + 1 for what follows the last block (a final norm). Head parameters are not listed."""
    from wsitrain.models.freeze import head_prefixes
    from wsitrain.patch.blocks import model_blocks

    blocks = model_blocks(model)
    heads = head_prefixes(model)
    ids: dict[str, int] = {}
    seen = 0  # blocks passed so far, in parameter order (forward order for every trunk wsitrain builds)
    for name, _ in model.named_parameters():
        if name.split(".")[0] in heads or not name.startswith("features."):
            continue
        inside = next((i for i, b in enumerate(blocks) if name.startswith(b + ".")), None)
        if inside is not None:
            seen = inside + 1
            ids[name] = inside + 1
        else:
            ids[name] = len(blocks) + 1 if seen == len(blocks) and blocks else 0
    return ids, len(blocks)


def parameter_groups(model: torch.nn.Module, lr: float, backbone_lr_scale: float = 1.0,
                     layer_decay: float | None = None) -> ParamGroups:  # fmt: skip
    """The trainable parameters as optimizer groups: one group at ``lr``, or with ``backbone_lr_scale`` < 1 the head
    (everything after the trunk) at ``lr`` first and the trunk at ``lr * backbone_lr_scale`` second.

    ``layer_decay`` (``train.layer_decay``, as ViT fine-tuning recipes use): the trunk is split by layer
    (``layer_ids``): of n blocks, block i (0-based) trains at ``lr * scale * decay ** (n - i)``, the stem (patch
    embedding) below the first block at ``decay ** (n + 1)``, what follows the last block (a final norm) and the head
    at the full rate; one group per layer, named ``layer_<id>``.

    The head comes first so ``param_groups[0]["lr"]`` (the lr the logs show) is the base rate. A frozen parameter is
    in no group; an empty group is left out (a trunk frozen whole)."""
    from wsitrain.models.freeze import head_prefixes

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    heads = head_prefixes(model)
    if layer_decay is not None and layer_decay != 1.0:
        ids, n = layer_ids(model)
        head = [p for name, p in trainable if name not in ids]
        groups = [{"params": head, "lr": lr, "name": "head"}]
        for layer in range(n + 2):
            params = [p for name, p in trainable if ids.get(name) == layer]
            scale = 1.0 if layer == n + 1 else layer_decay ** (n + 1 - layer)
            groups.append({"params": params, "lr": lr * backbone_lr_scale * scale, "name": f"layer_{layer}"})
        return [g for g in groups if g["params"]]
    if backbone_lr_scale == 1.0 or not heads:
        return [{"params": [p for _, p in trainable], "lr": lr, "name": "all"}]
    head = [p for n, p in trainable if n.split(".")[0] in heads]
    trunk = [p for n, p in trainable if n.split(".")[0] not in heads]
    groups = [{"params": head, "lr": lr, "name": "head"},
              {"params": trunk, "lr": lr * backbone_lr_scale, "name": "backbone"}]  # fmt: skip
    return [g for g in groups if g["params"]]


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | ParamGroups, name: str, lr: float, momentum: float = 0.9,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """The optimizer named by ``train.optimizer``, over the parameters that require gradients (or ``parameter_groups``,
    each group with its own lr)."""
    items = list(params)
    if items and isinstance(items[0], dict):
        params = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in items]
    else:
        params = [p for p in items if p.requires_grad]
    key = str(name).lower()
    if key == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if key == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if key == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ConfigError([f"train.optimizer: unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}"])


def lr_factor(step: int, schedule: str, total_steps: int, warmup_steps: int = 0) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Every schedule starts with a linear warmup over ``warmup_steps`` when that is > 0; then "constant" (or
    "warmup") stays at 1 and "cosine" decays from 1 to 0 over the remaining steps.
    """
    key = str(schedule).lower()
    if key not in SCHEDULES:
        raise ConfigError([f"train.schedule: unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"])
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if key in ("constant", "warmup"):
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, total_steps: int, warmup_steps: int = 0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is just the step count, so it checkpoints and resumes exactly)."""
    lr_factor(0, schedule, total_steps, warmup_steps)  # validate the name now, before training starts
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, schedule, total_steps, warmup_steps)
    )


def compute_loss(logits: torch.Tensor, target: torch.Tensor, loss: str) -> torch.Tensor:
    """Cross-entropy on class indices, or MSE between softmax-free outputs and one-hot targets (the paper's benchmark).

    Computed in float32 so bf16/fp16 autocast does not lose the loss's precision.
    """
    logits = logits.float()
    key = str(loss).lower()
    if key == "cross_entropy":
        return F.cross_entropy(logits, target)
    if key == "mse":
        onehot = F.one_hot(target, num_classes=logits.shape[1]).to(logits.dtype)
        return F.mse_loss(logits, onehot)
    raise ConfigError([f"train.loss: unknown loss {loss!r}; choose one of {', '.join(LOSSES)}"])


def probabilities(logits: torch.Tensor, loss: str) -> torch.Tensor:
    """Class probabilities from the model's outputs: softmax for both losses (MSE outputs are scores too)."""
    return torch.softmax(logits.float(), dim=1)
