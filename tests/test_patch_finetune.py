"""Fine-tuning a patch encoder the way ViTs are fine-tuned: ``model.freeze.last_blocks`` and block names, LoRA
(``model.lora``, peft) and layer-wise learning-rate decay (``train.layer_decay``), with their config keys."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from torch import nn

from wsitrain.config import load_config
from wsitrain.errors import ConfigError, WsiTrainError
from wsitrain.models.freeze import FreezeSpec, apply_freeze
from wsitrain.models.zoo import patch_model
from wsitrain.patch.blocks import model_blocks
from wsitrain.patch.lora import LoraSpec, add_lora, lora_layers, merge_lora
from wsitrain.train.optim import build_optimizer, layer_ids, parameter_groups

DEPTH, DIM, PATCH = 4, 24, 16


def _vit_model(seed: int = 0) -> nn.Sequential:
    """A tiny timm ViT (4 blocks of width 24, 16 px patches of 8 px tokens) as a patch model with an attention head."""
    torch.manual_seed(seed)
    enc = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=PATCH, patch_size=8,
                            depth=DEPTH, embed_dim=DIM, num_heads=2)  # fmt: skip
    return patch_model("timm/vit_tiny_patch16_224", enc, PATCH, DIM, 2, pool="attention")


def _trainable(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---- config keys --------------------------------------------------------------------------------------------
def test_config_keys_load(write_yaml) -> None:
    cfg = load_config(write_yaml(
        "model: {name: timm/vit_tiny_patch16_224, patch: 32, lora: {rank: 4, alpha: 8, targets: [qkv, proj]},\n"
        "        freeze: {last_blocks: 2}}\n"
        "train: {layer_decay: 0.75}\n"))  # fmt: skip
    assert cfg.model.patch == 32 and cfg.train.layer_decay == 0.75
    assert cfg.model.lora_spec() == LoraSpec(4, 8.0, ("qkv", "proj"), 0.0)
    assert cfg.model.freeze_spec() == FreezeSpec(None, (), 2)
    assert load_config(write_yaml("model: {name: timm/vit_tiny_patch16_224}")).model.lora_spec() is None


def test_config_errors_are_collected(write_yaml) -> None:
    text = ("model: {name: tiny, lora: {rank: 0}, freeze: {until: conv2, last_blocks: 1}}\n"
            "train: {layer_decay: 1.5}\n")  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(text))
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert "model.lora.rank" in msg and "train.layer_decay" in msg and "until and last_blocks" in msg


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("{name: tiny, lora: {rank: 4}}", "model.lora applies to patch encoders; tiny tiles the whole slide"),
        ("{name: tiny, freeze: {last_blocks: 1}}", "model.freeze.last_blocks applies to patch encoders"),
        ("{name: 'python:json.decoder:JSONDecoder'}", "model.patch is required with python:json.decoder"),
        ("{name: timm/vit_tiny_patch16_224, lora: {targets: [' qkv']}}", "is not a layer name"),
    ],
)
def test_patch_encoder_keys_need_a_patch_encoder(write_yaml, model: str, says: str) -> None:
    with pytest.raises(ConfigError, match="model") as err:
        load_config(write_yaml(f"model: {model}\n"))
    assert says in str(err.value)


def test_a_cnn_with_a_patch_size_takes_lora_keys(write_yaml) -> None:
    cfg = load_config(write_yaml("model: {name: tiny, patch: 32, lora: {targets: [conv2]}}\n"))
    assert cfg.model.lora_spec().targets == ("conv2",)


# ---- freezing blocks ----------------------------------------------------------------------------------------
def test_last_blocks_trains_only_the_last_blocks_and_the_head() -> None:
    model = _vit_model()
    frozen = apply_freeze(model, FreezeSpec(last_blocks=2))
    assert frozen is not None
    train = _trainable(model)
    enc = "features.encoder."
    assert {f"{enc}cls_token", f"{enc}pos_embed", f"{enc}patch_embed.proj.weight"}.isdisjoint(train)
    assert not any(n.startswith((f"{enc}blocks.0.", f"{enc}blocks.1.")) for n in train)
    assert any(n.startswith(f"{enc}blocks.2.") for n in train) and f"{enc}blocks.3.mlp.fc2.weight" in train
    assert f"{enc}norm.weight" in train and "classifier.weight" in train
    assert any(n.startswith("attention.") for n in train)
    # the engine reads the frozen modules: the stem and the first two blocks, never the encoder as a whole
    assert "features.encoder" not in frozen.modules
    assert f"{enc}blocks.0" in frozen.modules and f"{enc}patch_embed" in frozen.modules


def test_last_blocks_zero_freezes_the_encoder_and_too_many_is_an_error() -> None:
    model = _vit_model()
    apply_freeze(model, FreezeSpec(last_blocks=0))
    assert not any(n.startswith("features.") for n in _trainable(model)) and "classifier.weight" in _trainable(model)
    with pytest.raises(WsiTrainError, match=r"last_blocks: 9, but .* has 4 blocks \(features.encoder.blocks.0 \.\.\. "
                                            r"features.encoder.blocks.3\)") as err:  # fmt: skip
        apply_freeze(_vit_model(), FreezeSpec(last_blocks=9))
    assert err.value.exit_code == 2 and "choose 0 to 4" in (err.value.hint or "")


def test_until_a_block_by_its_short_name_freezes_the_tokens_too() -> None:
    model = _vit_model()
    apply_freeze(model, FreezeSpec(until="blocks.1"))
    train = _trainable(model)
    assert "features.encoder.cls_token" not in train and "features.encoder.pos_embed" not in train
    assert not any(n.startswith("features.encoder.blocks.1.") for n in train)
    assert any(n.startswith("features.encoder.blocks.2.") for n in train)
    with pytest.raises(WsiTrainError, match="has no module 'blocks.7'") as err:
        apply_freeze(_vit_model(), FreezeSpec(until="blocks.7"))
    assert "blocks.3" in (err.value.hint or "")  # the names there are, the encoder's blocks among them


def test_last_blocks_on_a_whole_slide_trunk_is_an_error() -> None:
    from wsitrain.models.zoo import build

    with pytest.raises(WsiTrainError, match="last_blocks applies to patch encoders"):
        apply_freeze(build("tiny", 2), FreezeSpec(last_blocks=1))


# ---- layer-wise learning-rate decay -------------------------------------------------------------------------
def test_layer_decay_groups() -> None:
    model = _vit_model()
    ids, n = layer_ids(model)
    assert n == DEPTH and model_blocks(model)[0] == "features.encoder.blocks.0"
    enc = "features.encoder."
    assert ids[f"{enc}cls_token"] == ids[f"{enc}patch_embed.proj.weight"] == 0
    assert ids[f"{enc}blocks.2.attn.qkv.weight"] == 3 and ids[f"{enc}norm.weight"] == DEPTH + 1
    lr, decay = 1e-3, 0.5
    groups = parameter_groups(model, lr, layer_decay=decay)
    by_name = {g["name"]: g for g in groups}
    assert groups[0]["name"] == "head" and groups[0]["lr"] == lr
    assert by_name["layer_0"]["lr"] == pytest.approx(lr * decay ** (DEPTH + 1))  # the patch embedding lowest
    for i in range(DEPTH):  # block i of n: lr * decay ** (n - i)
        assert by_name[f"layer_{i + 1}"]["lr"] == pytest.approx(lr * decay ** (DEPTH - i))
    assert by_name[f"layer_{DEPTH + 1}"]["lr"] == lr  # the final norm, as the head
    every = [id(p) for g in groups for p in g["params"]]
    assert len(every) == len(set(every)) == sum(1 for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(groups, "adamw", lr)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in groups]
    with_scale = parameter_groups(model, lr, backbone_lr_scale=0.1, layer_decay=decay)
    assert {g["name"]: g["lr"] for g in with_scale}["layer_4"] == pytest.approx(lr * 0.1 * decay)


def test_layer_decay_leaves_frozen_blocks_out() -> None:
    model = _vit_model()
    apply_freeze(model, FreezeSpec(last_blocks=1))
    names = [g["name"] for g in parameter_groups(model, 1e-3, layer_decay=0.7)]
    assert names == ["head", "layer_4", "layer_5"]


# ---- LoRA ---------------------------------------------------------------------------------------------------
def _step(model: nn.Module, x: torch.Tensor) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss = nn.functional.cross_entropy(model(x), torch.tensor([1]))
    loss.backward()
    opt.step()


def test_lora_trains_only_adapters_and_head_and_round_trips() -> None:
    model = _vit_model().double()
    n = add_lora(model, LoraSpec(rank=2, alpha=4, targets=("qkv", "fc2")))
    assert n == 2 * DEPTH and len(lora_layers(model)) == 2 * DEPTH
    train = _trainable(model)
    enc = {n for n in train if n.startswith("features.")}
    assert enc and all(".lora_A." in n or ".lora_B." in n for n in enc)
    assert "classifier.weight" in train
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    x = torch.rand(1, 3, 2 * PATCH, 3 * PATCH, dtype=torch.float64)
    lora_b = model.features.encoder.blocks[0].attn.qkv.lora_B["default"].weight.clone()
    _step(model, x)
    after = model.state_dict()
    for k, v in base.items():
        if k.startswith("features."):  # the encoder's own weights: unchanged by the step
            torch.testing.assert_close(after[k], v, rtol=0, atol=0)
    assert not torch.equal(model.features.encoder.blocks[0].attn.qkv.lora_B["default"].weight, lora_b)
    # saved and loaded: a model built the same way (with model.lora) takes the state and gives the same logits
    fresh = _vit_model(seed=3).double()
    add_lora(fresh, LoraSpec(rank=2, alpha=4, targets=("qkv", "fc2")))
    fresh.load_state_dict(copy.deepcopy(model.state_dict()))
    model.eval(), fresh.eval()
    torch.testing.assert_close(fresh(x), model(x))
    # merged into the base weights: the plain architecture, the same logits
    merged = merge_lora(copy.deepcopy(model))
    assert not lora_layers(merged) and isinstance(merged.features.encoder.blocks[0].attn.qkv, nn.Linear)
    torch.testing.assert_close(merged(x), model(x))


def test_lora_inside_frozen_blocks_stays_frozen() -> None:
    model = _vit_model()
    add_lora(model, LoraSpec(rank=2, targets=("qkv",)), FreezeSpec(last_blocks=1))
    adapters = {n for n in _trainable(model) if "lora_" in n}
    assert adapters and all(n.startswith("features.encoder.blocks.3.") for n in adapters)


def test_lora_target_that_names_no_layer() -> None:
    with pytest.raises(WsiTrainError, match="model.lora.targets: .* has no layer 'q_proj'") as err:
        add_lora(_vit_model(), LoraSpec(targets=("q_proj",)))
    assert "qkv" in (err.value.hint or "") and err.value.exit_code == 2
    from wsitrain.models.zoo import build

    with pytest.raises(WsiTrainError, match="model.lora applies to patch encoders"):
        add_lora(build("tiny", 2), LoraSpec())


def test_a_lora_runs_weights_start_another_lora_run(tmp_path) -> None:
    """``model.weights`` holding adapters: the run's model gets its adapters first, then the file's state (strict)."""
    from wsitrain.config import WsiTrainConfig
    from wsitrain.train.engine import build_model

    m = {"name": "python:tests.fake_hub:tiny_vit", "patch": 16, "pool": "attention",
         "lora": {"rank": 2, "targets": ["qkv"]}}  # fmt: skip
    torch.manual_seed(0)
    first = build_model(WsiTrainConfig.model_validate({"model": m}).model, 2)
    for name, p in first.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to carry over
            nn.init.normal_(p)
    file = tmp_path / "best.pt"
    torch.save({"model": first.state_dict()}, file)
    torch.manual_seed(1)
    second = build_model(WsiTrainConfig.model_validate({"model": {**m, "weights": str(file)}}).model, 2)
    for k, v in first.state_dict().items():
        torch.testing.assert_close(second.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert {n for n, p in second.named_parameters() if p.requires_grad and n.startswith("features.")} == {
        n for n in second.state_dict() if "lora_" in n}
