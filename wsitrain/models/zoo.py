"""Model builders: every model is one plain ``nn.Sequential`` chain the SFT engine can trace.

Layout: ``normalize -> features (trunk) -> pool -> flatten -> classifier``. A plain Sequential (not a
subclass) so slicing ``model[:2]`` works and torch.fx sees a straight chain; ``model.name`` and
``model.stride`` (the trunk's total downsampling) are plain attributes. Built-ins are assembled here;
``torchvision/<name>`` and ``timm/<name>`` models are the library's own modules, split at their global pooling
(wsitrain.models.split).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.attention import (
    AttentionPool,
    AttentionScores,
    BranchClassifier,
    InstanceSplit,
    InstanceStream,
    slide_norm,
)
from wsitrain.models.freeze import FreezeSpec, apply_freeze
from wsitrain.models.frozen_bn import freeze_batchnorm
from wsitrain.models.heads import (
    ATTENTION_POOLS,
    AVG,
    DEFAULT_TOPK,
    GATED_ATTENTION,
    MAP_NORMS,
    NO_NORM,
    POOLS,
    SLIDE_NORM,
    TOPK,
    AttentionSpec,
)
from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD, InputNormalization
from wsitrain.models.registry import BUILTIN_NAMES, ModelSpec, is_imagenet, resolve_model_name
from wsitrain.models.slide_bn import BN_STATS, RUNNING, SLIDE, slide_batchnorm
from wsitrain.models.trunks import TRUNKS as _TRUNKS
from wsitrain.models.trunks import Norm, input_normalization
from wsitrain.models.weights import load_weights
from wsitrain.sft.ops.masked_pool import MaskedAvgPool2d, MaskedMaxPool2d
from wsitrain.sft.ops.topk_pool import MaskedTopKMean

MODEL_NAMES = BUILTIN_NAMES  # the built-in names; any torchvision/<name> or timm/<name> is valid as well


Parts = tuple[nn.Module, nn.Module, int, int, Norm]  # trunk, classifier, trunk channels, stride, normalization


def _builtin_parts(spec: ModelSpec, num_classes: int, imagenet: bool) -> Parts:
    if imagenet and spec.imagenet_from is None:
        raise WsiTrainError(
            f"built-in model {spec.name!r} has no ImageNet weights",
            hint="use model.weights: imagenet with resnet18/34/50, vgg16/19, torchvision/<name> or timm/<name>, "
            "or give a local state-dict file",
        )
    make_trunk, channels = _TRUNKS[spec.name]
    assert spec.stride is not None  # every built-in has its stride in the registry
    return make_trunk(imagenet), nn.Linear(channels, num_classes), channels, spec.stride, input_normalization(spec)


def _library_parts(spec: ModelSpec, num_classes: int, imagenet: bool) -> Parts:
    import wsitrain.models.pretrained as pretrained
    from wsitrain.models.split import split_classifier

    if spec.source == "torchvision":
        net = pretrained.torchvision_net(spec.arch, imagenet)
    else:
        net = pretrained.timm_net(spec.arch, imagenet)
    norm = input_normalization(spec)
    if getattr(net, "transform_input", False):
        # GoogLeNet / Inception-v3 with ImageNet weights re-normalize ImageNet-normalized input to (x - 0.5) / 0.5
        # in their forward (channel slicing the engine cannot tile): normalize that way up front instead.
        net.transform_input = False
        norm = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    parts = split_classifier(net, spec.name, num_classes)
    return parts.features, parts.classifier, parts.channels, parts.stride, norm


def _pool_layers(pool: str, attention: AttentionSpec, channels: int, classifier: nn.Module, num_classes: int,
                 mask_pool: bool = True, topk: int = DEFAULT_TOPK) -> dict[str, nn.Module]:  # fmt: skip
    """The layers from the trunk's output to the logits (after ``features``), by ``pool``."""
    if pool not in ATTENTION_POOLS:
        glob: nn.Module
        if pool == TOPK:  # no torch counterpart: without a mask set it reads the whole map
            glob = MaskedTopKMean(topk)
        elif mask_pool:  # the torch pools, reading only tissue while a mask is set (``with model.pool.masked(mask)``)
            glob = MaskedAvgPool2d() if pool == AVG else MaskedMaxPool2d()
        else:
            glob = nn.AdaptiveAvgPool2d(1) if pool == AVG else nn.AdaptiveMaxPool2d(1)
        return {"pool": glob, "flatten": nn.Flatten(1), "classifier": classifier}
    branches = num_classes if attention.per_class else 1
    scores = AttentionScores(channels, branches, attention.dim, attention.hidden, gated=pool == GATED_ATTENTION,
                             norm=attention.norm)  # fmt: skip
    if attention.dim is not None:
        # the library's pre-logits layers (a LayerNorm, an MLP) expect the trunk's width, not the projection's
        classifier = nn.Linear(attention.dim, num_classes)
    pooled = AttentionPool(branches, attention.instance_k, attention.border)
    # the scores the instance loss reads end at ``flatten`` (InstanceSplit); without it, the plain layers
    flatten: nn.Module = nn.Identity() if branches > 1 else nn.Flatten(1)
    if attention.instance_k:
        flatten = InstanceSplit(attention.instance_k, flatten=branches == 1)
    if attention.stream_class is not None:  # the scores reach the classifier: no split before it
        if branches == 1 or not attention.instance_k:
            raise ValueError("an instance stream needs one attention branch per class and the pool's instance scores")
        stream = InstanceStream(BranchClassifier(classifier), attention.instance_k, attention.stream_class,
                                attention.stream_cells)  # fmt: skip
        return {"attention": scores, "pool": pooled, "classifier": stream}
    if branches > 1:  # (B, K, C) -> class k of branch k (B, K)
        return {"attention": scores, "pool": pooled, "flatten": flatten, "classifier": BranchClassifier(classifier)}
    return {"attention": scores, "pool": pooled, "flatten": flatten, "classifier": classifier}


def build(
    name: str,
    num_classes: int,
    weights: str | Path | None = None,
    pool: str = "avg",
    freeze_bn: bool = True,
    attention: AttentionSpec | None = None,
    freeze: FreezeSpec | None = None,
    mask_pool: bool = True,
    topk: int = DEFAULT_TOPK,
    map_norm: str = NO_NORM,
    bn_stats: str = RUNNING,
    patch: int | None = None,
) -> nn.Sequential:
    """Build model ``name`` (a built-in, ``torchvision/<name>`` or ``timm/<name>``) with a ``num_classes``-way head.

    ``weights``: ``"imagenet"`` for the library's own pretrained weights (read from its cache; see
    wsitrain.models.pretrained), or a local file: a state dict of this exact model (as saved by
    ``torch.save(model.state_dict(), path)``), of its trunk alone (the head stays as built), or a wsitrain run
    checkpoint (``best.pt``/``last.pt``).
    ``pool``: global "avg" or "max" pooling before the head, or attention-MIL pooling ("attention",
    "gated_attention"; built as ``attention`` says, wsitrain.models.attention). ``freeze_bn``: BatchNorm layers
    keep their running statistics even in ``model.train()``. ``freeze``: modules kept fixed (wsitrain.models.freeze;
    ``model.frozen`` says what was frozen, None when nothing).
    ``mask_pool``: an "avg" or "max" pool that reduces over the positions of a mask set with ``model.pool.masked(mask)``
    only (wsitrain.sft.ops.masked_pool; fit and predict set the slide's tissue); False: torch's own pools.
    ``topk``: the k of ``pool="topk"`` (each channel's mean of its k largest positions, wsitrain.sft.ops.topk_pool).
    ``map_norm``: "slide" puts a ``map_norm`` module between the trunk and the head that standardises each channel of
    the trunk's map over the slide (a BatchNorm without running statistics or affine parameters: batch statistics in
    training and prediction alike; the engine runs it exactly in two sweeps). The pool, the attention and the
    classifier, and so the CAM, read the standardised map. "none" (the default): no such module.
    ``patch``: apply the model as a patch encoder to every ``patch`` px patch of a grid (``model.patch``;
    wsitrain.patch): its embeddings form the map the head pools, stride ``patch``. Vision transformers, hub encoders
    and a user's ``python:`` module are patch encoders whatever ``patch`` says (None: the encoder's own input size).
    ``bn_stats``: "slide" makes every BatchNorm normalise with its batch's own statistics in prediction too
    (wsitrain.models.slide_bn; needs ``freeze_bn=False``); "running" (the default): PyTorch's running averages.
    """
    spec = resolve_model_name(name)
    if map_norm not in MAP_NORMS:
        raise WsiTrainError(f"unknown map_norm {map_norm!r} for model {name!r}", hint=f"choose one of: "
                            f"{', '.join(MAP_NORMS)}")  # fmt: skip
    if pool not in POOLS:
        raise WsiTrainError(f"unknown pool {pool!r} for model {name!r}", hint=f"choose one of: {', '.join(POOLS)}")
    if bn_stats not in BN_STATS:
        raise WsiTrainError(f"unknown bn_stats {bn_stats!r} for model {name!r}", hint=f"choose one of: "
                            f"{', '.join(BN_STATS)}")  # fmt: skip
    if bn_stats == SLIDE and freeze_bn:
        raise WsiTrainError("bn_stats 'slide' normalises with each slide's statistics, but freeze_bn keeps the "
                            "running ones", hint="set model.freeze_bn: false with model.bn_stats: slide")  # fmt: skip
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise WsiTrainError(
            f"num_classes must be a positive integer, got {num_classes!r}", hint="set it to the number of labels"
        )
    imagenet = is_imagenet(weights)
    if spec.patch_only or patch is not None:  # an encoder on every patch of a grid (wsitrain.patch)
        from wsitrain.patch.encoders import build_encoder

        enc, info = build_encoder(name, weights=None if weights is None or imagenet else Path(weights),
                                  pretrained=imagenet, patch=patch)  # fmt: skip
        model = patch_model(spec.name, enc, info.patch, info.dim, num_classes, (info.mean, info.std), pool=pool,
                            attention=attention, mask_pool=mask_pool, topk=topk, map_norm=map_norm)  # fmt: skip
    else:
        parts = _builtin_parts if spec.is_builtin else _library_parts
        model = assemble(spec.name, parts(spec, num_classes, imagenet), num_classes, pool, attention, mask_pool, topk,
                         map_norm)  # fmt: skip
        if weights is not None and not imagenet:
            load_weights(model, weights)
    if freeze_bn:
        freeze_batchnorm(model)
    if bn_stats == SLIDE:  # after the weights: a checkpoint or ImageNet file with running statistics still loads
        slide_batchnorm(model)
    apply_freeze(model, freeze)
    return model


def assemble(name: str, parts: Parts, num_classes: int, pool: str = AVG, attention: AttentionSpec | None = None,
             mask_pool: bool = True, topk: int = DEFAULT_TOPK, map_norm: str = NO_NORM) -> nn.Sequential:  # fmt: skip
    """``normalize -> features -> [map_norm] -> head`` from a trunk and its classifier (``build``'s layout; the
    patch models' too, ``patch_model``)."""
    features, classifier, channels, stride, (mean, std) = parts
    head = _pool_layers(pool, attention or AttentionSpec(), channels, classifier, num_classes, mask_pool, topk)
    # why a map norm: the trunk's level drifts while it trains, and a head reading it raw can stay on the plateau
    # (docs/research/plateau.md sections 12-13)
    norm = {"map_norm": slide_norm(channels)} if map_norm == SLIDE_NORM else {}
    model = nn.Sequential(OrderedDict(normalize=InputNormalization(mean, std), features=features, **norm, **head))
    model.name = name
    model.stride = stride
    return model


def patch_model(name: str, encoder: nn.Module, patch: int, dim: int, num_classes: int,
                norm: Norm = (IMAGENET_MEAN, IMAGENET_STD), **head: object) -> nn.Sequential:  # fmt: skip
    """A patch-encoder model: ``encoder`` ((N, 3, patch, patch) -> (N, dim)) on every patch of the slide
    (``wsitrain.patch.trunk.PatchTrunk``, stride ``patch``), the embedding map pooled by the head ``head`` names
    (``assemble``'s pool, attention, mask_pool, topk, map_norm), as ``build`` makes every model."""
    from wsitrain.patch.trunk import PatchTrunk

    ref = next(iter(encoder.parameters()), None)
    classifier = nn.Linear(dim, num_classes, device=ref.device if ref is not None else None,
                           dtype=ref.dtype if ref is not None else None)  # fmt: skip
    parts: Parts = (PatchTrunk(encoder, patch, dim), classifier, dim, patch, norm)
    return assemble(name, parts, num_classes, **head)  # type: ignore[arg-type]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the parameters occupy in their current dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
