"""`wsitrain models`: the built-in models, how to name any torchvision or timm CNN, and one model described.

Models are built on the meta device here: shapes and parameter counts without allocating or initialising weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from wsitrain.models.registry import (
    BUILTIN_MODELS,
    HF_HUB_PREFIX,
    IMAGENET,
    PYTHON_PREFIX,
    TIMM_PREFIX,
    TORCHVISION_PREFIX,
    ModelSpec,
    resolve_model_name,
    timm_installed,
    torchvision_cnn_names,
    torchvision_patch_names,
)


@dataclass(frozen=True)
class ModelFacts:
    """What `wsitrain models NAME` shows."""

    spec: ModelSpec
    trunk_parameters: int
    head_parameters: int
    stride: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classifier: str  # the head's layers, one line
    imagenet: str  # where `model.weights: imagenet` reads from, and whether the file is there


def _imagenet_source(spec: ModelSpec) -> str:
    from wsitrain.models import pretrained

    if spec.is_builtin and spec.imagenet_from is None:
        return "none (no ImageNet weights for this built-in)"
    try:
        if spec.source == "timm":
            files, _ = pretrained.timm_cache_files(spec.arch)
            cached = pretrained.timm_cached(spec.arch)
            where = " or ".join(str(f) for f in files)
        else:
            path, _ = pretrained.torchvision_cache_file(spec.imagenet_from or spec.arch)
            cached, where = path.is_file(), str(path)
    except Exception as exc:  # a library without weights for this name: say so instead of failing the listing
        return f"not available ({exc})"
    return f"{where} ({'cached' if cached else 'not cached: downloaded on first use, or see the error for offline'})"


def _layer(m: torch.nn.Module) -> str:
    if isinstance(m, torch.nn.Linear):
        return f"Linear({m.in_features} -> {m.out_features})"
    return type(m).__name__


def describe(name: str) -> ModelFacts:
    """Facts about model ``name``, built on the meta device (nothing allocated, nothing downloaded)."""
    from wsitrain.models.zoo import build, input_normalization

    spec = resolve_model_name(name, key="NAME")
    with torch.device("meta"):
        model = build(name, num_classes=2, freeze_bn=False)
    mean, std = input_normalization(spec)
    cls = model.classifier
    head = [_layer(m) for m in (cls.children() if isinstance(cls, torch.nn.Sequential) else [cls])]
    return ModelFacts(
        spec=spec,
        trunk_parameters=sum(p.numel() for p in model.features.parameters()),
        head_parameters=sum(p.numel() for p in model.classifier.parameters()),
        stride=int(model.stride),
        mean=tuple(mean),
        std=tuple(std),
        classifier=" -> ".join([f"{type(model.pool).__name__}(1)", "Flatten", *head]),
        imagenet=_imagenet_source(spec),
    )


def builtin_table() -> Table:
    """One row per built-in model: name, trunk parameters, stride, what it is."""
    from wsitrain.models.zoo import build

    table = Table(title="built-in models", title_justify="left")
    for col in ("name", "trunk parameters", "stride", "what it is", "model.weights: imagenet"):
        table.add_column(col, justify="right" if col in ("trunk parameters", "stride") else "left")
    for spec in BUILTIN_MODELS.values():
        with torch.device("meta"):
            model = build(spec.name, num_classes=2, freeze_bn=False)
        n = sum(p.numel() for p in model.features.parameters())
        imagenet = f"torchvision {spec.imagenet_from}" if spec.imagenet_from else "-"
        table.add_row(spec.name, f"{n:,}", str(spec.stride), spec.summary, imagenet)
    return table


def _families(names: list[str]) -> list[str]:
    """torchvision's CNN names, one line per family (the name's leading letters): easier to scan than 60 names."""
    groups: dict[str, list[str]] = {}
    for n in names:
        family = re.match(r"[a-z]*", n).group(0)  # type: ignore[union-attr]  # "[a-z]*" always matches
        groups.setdefault(family, []).append(n)
    return [f"  {family}: {', '.join(members)}" for family, members in groups.items()]


def print_models(console: Console, name: str | None = None) -> None:
    """`wsitrain models [NAME]`."""
    if name is not None:
        facts = describe(name)
        table = Table(title=facts.spec.name, show_header=False, title_justify="left")
        rows = {
            "what": facts.spec.summary,
            "trunk parameters": f"{facts.trunk_parameters:,}",
            "head parameters": f"{facts.head_parameters:,} (with 2 classes)",
            "stride": str(facts.stride),
            "head": facts.classifier,
            "input normalization": f"mean {facts.mean}, std {facts.std} (uint8 input is scaled to [0, 1] first)",
            f"model.weights: {IMAGENET}": facts.imagenet,
        }
        for key, value in rows.items():
            table.add_row(f"[bold]{key}[/]", value)
        console.print(table)
        return
    console.print(builtin_table())
    console.print(
        f"\n[bold]{TORCHVISION_PREFIX}<name>[/]: any torchvision classification CNN: its own modules up to its last "
        "global pooling are the trunk, its head up to the last Linear is kept with a new Linear for your classes.\n"
        + "\n".join(_families(torchvision_cnn_names()))
    )
    timm_note = "installed" if timm_installed() else "not installed: pip install 'wsitrain[timm]'"
    console.print(
        f"\n[bold]{TIMM_PREFIX}<name>[/]: a timm CNN, e.g. timm/resnet18 or timm/convnext_tiny.fb_in22k "
        f"(a pretrained tag after the dot); timm is {timm_note}. timm.list_models('efficientnet*') lists names."
    )
    console.print(
        "\n[bold]Patch encoders[/] (applied to every model.patch px patch; docs/guide/foundation-models-training.md): "
        f"timm ViTs (timm/vit_small_patch16_224), torchvision/ {', '.join(torchvision_patch_names())}, "
        f"{TIMM_PREFIX}{HF_HUB_PREFIX}<org>/<name> from your Hugging Face cache (UNI, Virchow2, H-optimus-0), "
        f"{PYTHON_PREFIX}<module>:<function> for your own module, and any CNN above with model.patch set."
    )
    console.print(
        f"\n[bold]model.weights[/]: `{IMAGENET}` reads the library's own pretrained weights from its cache "
        "(TORCH_HOME for torchvision, the Hugging Face cache HF_HOME / HF_HUB_CACHE for timm); or a local state "
        "dict; or best.pt / last.pt of a wsitrain run. `wsitrain models NAME` shows one model and its cache file; "
        "`wsitrain plan --model NAME` shows how much of it the engine tiles."
    )
