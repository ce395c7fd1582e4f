"""The frozen-feature cache (wsitrain.train.feature_cache): a frozen patch encoder's bags computed once per slide and
augmentation, read back from disk through the safe loader, keyed by the encoder's weights and patch size; the head of
the frozen-feature pipeline (wsitrain.train.frozen_mil) trains on them, the encoder never moving."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.train import frozen_mil as FM
from wsitrain.train.feature_cache import DIHEDRAL, FeatureCache, dihedral, fingerprint

VIT = "python:tests.fake_hub:tiny_vit"  # 2 blocks of width 24 on 16 px patches


@pytest.fixture(scope="module")
def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return FM.build_frozen_mil(VIT, 2, patch=16)


def test_the_encoder_is_frozen_and_gives_one_vector_per_patch(model: torch.nn.Sequential) -> None:
    assert not any(p.requires_grad for p in model.features.parameters())
    assert all(p.requires_grad for n in FM.HEAD_PARTS for p in getattr(model, n).parameters())
    feats = FM.patch_features(model, torch.rand(1, 3, 48, 40), 16)
    assert feats.shape == (3 * 2, 24)


def test_bags_are_computed_once_and_read_back(model: torch.nn.Sequential, tmp_path: Path) -> None:
    img = torch.rand(1, 3, 48, 48, generator=torch.Generator().manual_seed(2))
    reads: list[int] = []

    def image() -> torch.Tensor:
        reads.append(1)
        return img

    cache = FeatureCache(tmp_path, model, 16)
    first = [cache.bag("slide_a", k, image) for k in range(DIHEDRAL)]
    assert (cache.computed, cache.hits, len(reads)) == (DIHEDRAL, 0, DIHEDRAL)
    for k in range(DIHEDRAL):
        torch.testing.assert_close(first[k], FM.patch_features(model, dihedral(img, k), 16), rtol=0, atol=0)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[5])  # 8 different bags
    again = FeatureCache(tmp_path, model, 16)  # a new run on the same encoder: every bag read from disk
    for k in range(DIHEDRAL):
        torch.testing.assert_close(again.bag("slide_a", k, image), first[k], rtol=0, atol=0)
    assert (again.computed, again.hits, len(reads)) == (0, DIHEDRAL, DIHEDRAL)


def test_another_encoder_or_patch_size_never_reads_the_cache(model: torch.nn.Sequential) -> None:
    torch.manual_seed(1)
    other = FM.build_frozen_mil(VIT, 2, patch=16)
    assert fingerprint(other, 16) != fingerprint(model, 16) != fingerprint(model, 32)
    head_changed = FM.build_frozen_mil(VIT, 2, patch=16)
    head_changed.load_state_dict(model.state_dict())
    torch.nn.init.normal_(head_changed.classifier.weight)
    assert fingerprint(head_changed, 16) == fingerprint(model, 16)  # the head is not part of the embeddings


def test_a_planted_cache_file_is_refused(model: torch.nn.Sequential, tmp_path: Path) -> None:
    cache = FeatureCache(tmp_path, model, 16)
    path = cache.path("slide_b", 0)
    path.parent.mkdir(parents=True)
    torch.save({"x": print}, path)  # a pickle that names a global: the safe loader runs nothing of it
    with pytest.raises(WsiTrainError, match="feature cache file"):
        cache.bag("slide_b", 0, lambda: torch.rand(1, 3, 16, 16))


def test_dihedral_is_the_flips_and_quarter_turns() -> None:
    x = torch.arange(6.0).view(1, 1, 2, 3)
    assert torch.equal(dihedral(x, 0), x) and torch.equal(dihedral(x, 4), x.flip(-1))
    assert torch.equal(dihedral(x, 1), torch.rot90(x, 1, (-2, -1)))
    with pytest.raises(ValueError, match="augmentation 8"):
        dihedral(x, 8)


def test_head_trains_on_augmented_views_and_the_encoder_stays(model: torch.nn.Sequential, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    images = [torch.rand(1, 3, 32, 32, generator=g) for _ in range(4)]
    for i in (1, 3):  # positives: a bright patch
        images[i][:, :, :16, :16] = 1.0
    cache = FeatureCache(tmp_path, model, 16)
    bags = [[cache.bag(f"s{i}", k, lambda i=i: images[i]) for k in range(4)] for i in range(4)]
    before = {k: v.clone() for k, v in model.features.state_dict().items()}
    fit = FM.train_head(model, bags, [0, 1, 0, 1], epochs=40, lr=1e-2, seed=0)
    assert fit.epochs == 40 and fit.train_loss[-1] < fit.train_loss[0]
    for k, v in model.features.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
