"""The frozen-feature baseline's pieces (wsitrain.train.frozen_mil): patches embedded once without autograd by the
frozen trunk, and only the model's own attention head trained on the bags."""

from __future__ import annotations

import torch

from wsitrain.models import zoo
from wsitrain.train import frozen_mil as FM


def test_patch_grid_row_major_and_ragged_edges_left_out() -> None:
    img = torch.arange(1 * 3 * 70 * 100, dtype=torch.float32).view(1, 3, 70, 100)
    patches, grid = FM.patch_grid(img, 32)
    assert grid == (2, 3) and patches.shape == (6, 3, 32, 32)
    torch.testing.assert_close(patches[4], img[0, :, 32:64, 32:64])  # row 1, column 1


def test_features_computed_once_per_patch_without_grad() -> None:
    torch.manual_seed(0)
    model = FM.build_frozen_mil("tiny", 2)
    assert all(not p.requires_grad for p in model.features.parameters())
    assert all(p.requires_grad for n in FM.HEAD_PARTS for p in getattr(model, n).parameters())
    seen: list[int] = []
    model.features.register_forward_hook(lambda _m, inp, out: seen.append(inp[0].shape[0]))
    img = torch.rand(1, 3, 96, 130)
    feats = FM.patch_features(model, img, 32, batch=4)
    assert sum(seen) == 3 * 4 and len(seen) == 3  # 12 patches, each through the trunk once (batches of 4)
    assert feats.shape == (12, 32) and not feats.requires_grad and feats.grad_fn is None
    with torch.no_grad():  # patch 5 (row 1, column 1) alone gives the same vector
        one = model.features(model.normalize(img[:, :, 32:64, 32:64])).mean(dim=(2, 3))[0]
    torch.testing.assert_close(feats[5], one)
    # no graph even where the trunk's weights do require grad: the features are constants to the head
    trainable = zoo.build("tiny", 2, pool="attention")
    assert FM.patch_features(trainable, img, 32).grad_fn is None


def test_head_trains_and_trunk_stays_fixed() -> None:
    torch.manual_seed(0)
    model = FM.build_frozen_mil("tiny", 2, pool="gated_attention")
    trunk = {k: v.clone() for k, v in model.features.state_dict().items()}
    # bags of 8 patch vectors; a positive bag holds one vector far off the others (a "lesion")
    g = torch.Generator().manual_seed(1)
    bags, labels = [], []
    for i in range(8):
        b = torch.rand(8, 32, generator=g)
        if i % 2:
            b[3] += 4.0
        bags.append(b)
        labels.append(i % 2)
    fit = FM.train_head(model, bags, labels, epochs=30, lr=1e-2, seed=0)
    assert fit.epochs == 30 and fit.train_loss[-1] < 0.5 * fit.train_loss[0]
    probs = FM.predict_bags(model, bags)[:, 1]
    assert bool((probs[1::2].min() > probs[0::2].max()).item())
    for k, v in model.features.state_dict().items():
        torch.testing.assert_close(v, trunk[k], rtol=0, atol=0)
    w = FM.attention_weights(model, bags[1])
    assert int(w.argmax()) == 3 and abs(float(w.sum()) - 1) < 1e-5


def test_budget_stops_after_an_epoch() -> None:
    model = FM.build_frozen_mil("tiny", 2)
    bags = [torch.rand(4, 32) for _ in range(2)]
    fit = FM.train_head(model, bags, [0, 1], epochs=50, lr=1e-3, seed=0, budget_s=0.0)
    assert fit.epochs == 1
