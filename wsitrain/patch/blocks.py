"""A patch encoder's blocks: the module paths ``model.freeze.last_blocks`` and ``train.layer_decay`` count in.

A ViT's ``blocks.0 ... blocks.11`` (timm's own grouping for timm models), torchvision's
``encoder.layers.encoder_layer_0 ...``, a CNN's stages. Everything of the encoder before the first block (patch and
position embeddings, a class token, a stem) is the "stem"; what follows the last block (a final norm) is the "tail".
"""

from __future__ import annotations

from torch import nn

ENCODER = "features.encoder"  # where a patch model keeps its encoder (wsitrain.patch.trunk.PatchTrunk in features)


def _timm_blocks(encoder: nn.Module) -> tuple[str, ...] | None:
    """A timm model's blocks as timm itself groups them for layer decay (``group_matcher(coarse=True)``): each group
    after the stem, as the module path its modules share (``blocks.3``, ``layer2``, ``stages.1``)."""
    matcher = getattr(encoder, "group_matcher", None)
    if matcher is None:
        return None
    from timm.models import group_modules

    try:
        groups = group_modules(encoder, matcher(coarse=True))
    except (NotImplementedError, TypeError, AttributeError):
        return None
    paths = []
    for gid in sorted(groups)[1:]:  # group 0 is the stem (patch embedding, position embedding, first conv)
        # the modules under the group's first top-level name: timm may put a final norm in the last block's group
        top = groups[gid][0].split(".")[0]
        parts = [name.split(".") for name in groups[gid] if name.split(".")[0] == top]
        common = []
        for level in zip(*parts, strict=False):
            if len(set(level)) != 1:
                break
            common.append(level[0])
        if common:
            paths.append(".".join(common))
    return tuple(paths) if len(paths) > 1 else None


def block_paths(encoder: nn.Module) -> tuple[str, ...]:
    """The encoder's repeated blocks in forward order: timm's own grouping for timm models (``_timm_blocks``); else
    the children holding parameters of its ``ModuleList`` / ``Sequential`` with the most such children
    (torchvision's ``encoder.layers.encoder_layer_0 ...``, a CNN trunk's layers). Empty when there is none."""
    timm_blocks = _timm_blocks(encoder)
    if timm_blocks is not None:
        return timm_blocks
    best: tuple[str, ...] = ()
    for path, module in encoder.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = tuple(
            f"{path}.{name}" if path else name
            for name, child in module.named_children()
            if any(True for _ in child.parameters())
        )
        if len(children) > len(best):
            best = children
    return best


def patch_encoder(model: nn.Module) -> nn.Module | None:
    """The patch encoder of a built model (``features.encoder``), or None for a whole-slide trunk."""
    try:
        return model.get_submodule(ENCODER)
    except AttributeError:
        return None


def model_blocks(model: nn.Module) -> tuple[str, ...]:
    """The blocks of a built model as full module paths: its patch encoder's (``features.encoder.blocks.3``), or for
    a whole-slide trunk the trunk's (``features.layer2``)."""
    encoder = patch_encoder(model)
    root, prefix = (encoder, f"{ENCODER}.") if encoder is not None else (model.get_submodule("features"), "features.")
    return tuple(prefix + b for b in block_paths(root))
