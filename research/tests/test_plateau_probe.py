"""research/plateau_probe.py's measuring pieces: the pointing game it logs and the max-instance score loss it tries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from script_module import load_script

from wsitrain.models import zoo


@pytest.fixture(scope="module")
def probe():
    return load_script("plateau_probe", "research")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.build("tiny", 2, pool="attention").eval()


def test_pointing_hits_a_lesion_box_over_the_top_cell_and_nothing_else(probe) -> None:
    model = _model()
    x = torch.rand(1, 3, 256, 192)
    with torch.no_grad():
        a = model.pool.weights(model[:3](x))[0, 0]  # (h, w)
        r, c = divmod(int(a.flatten().argmax()), a.shape[1])
        s = model.stride
        box = {"y0": r * s, "y1": (r + 1) * s, "x0": c * s, "x1": (c + 1) * s}
        other = {"y0": ((r + 2) % a.shape[0]) * s, "y1": ((r + 2) % a.shape[0] + 1) * s, "x0": box["x0"],
                 "x1": box["x1"]}  # fmt: skip
        assert probe.pointing(model, x, [{**box, "kind": "lesion"}])
        assert not probe.pointing(model, x, [{**box, "kind": "distractor"}])  # a look-alike's box is not a hit
        assert not probe.pointing(model, x, [{**other, "kind": "lesion"}])


@pytest.mark.parametrize("label", [0, 1])
def test_score_mil_loss_is_the_bce_of_the_highest_attention_score(probe, label: int) -> None:
    model = _model()
    x = torch.rand(1, 3, 128, 160)
    logits, aux = probe.score_mil_loss(model, x, label)
    hs = model[:3](x)
    top = hs[:, -1].flatten(1).max(1).values
    torch.testing.assert_close(logits, model(x))
    torch.testing.assert_close(aux, F.binary_cross_entropy_with_logits(top, torch.full_like(top, float(label))))
    aux.backward()  # the loss reaches the attention layers' weights
    assert model.attention.w.weight.grad is not None and model.attention.w.weight.grad.abs().sum() > 0


def test_null_slot_takes_its_share_and_its_value(probe) -> None:
    model = _model()
    x = torch.rand(1, 3, 128, 96)
    hs = model[:3](x)  # (1, C + 1, h, w)
    pool = probe.NullSlotPool(model.attention.out_channels, init_score=0.7)
    with torch.no_grad():
        pool.null_value.copy_(torch.randn_like(pool.null_value))
    n = hs.shape[-2] * hs.shape[-1]
    scores = torch.cat([hs[:, -1].flatten(1), (pool.null_score + torch.log(torch.tensor(float(n))))[None, None]], 1)
    a = torch.softmax(scores, 1)  # (1, N + 1): the map's positions, then the slot
    want = a[:, :-1] @ hs[0, :-1].flatten(1).T + a[:, -1:] * pool.null_value  # (1, C)
    torch.testing.assert_close(pool(hs)[:, 0], want)
    torch.testing.assert_close(pool.weights(hs).sum(), 1 - a[0, -1])  # the map keeps what the slot leaves
    pool(hs).sum().backward()
    assert pool.null_score.grad is not None and pool.null_value.grad is not None


@pytest.mark.parametrize("temperature", [1.0, 0.0, -4.0])
def test_evidence_pool_weights_the_classifier_s_positive_evidence(probe, temperature: float) -> None:
    model = _model()
    model.pool = probe.EvidencePool(model.classifier, temperature)
    x = torch.rand(1, 3, 96, 128)
    with torch.no_grad():
        hs = model[:3](x)
        w = model.classifier.weight
        evidence = torch.einsum("c,chw->hw", w[1] - w[0], hs[0, :-1]).flatten()
        a = model.pool.weights(hs).flatten()
        if temperature == 0:  # a hard maximum: the logit difference is the top cell's evidence
            assert a.sum() == 1 and a[evidence.argmax()] == 1
            logits = model(x)[0]
            torch.testing.assert_close(logits[1] - logits[0], evidence.max() + model.classifier.bias[1]
                                       - model.classifier.bias[0])  # fmt: skip
        elif temperature > 0:
            torch.testing.assert_close(a, torch.softmax(evidence / temperature, 0))
        else:
            z = (evidence - evidence.mean()) / (evidence.std() + 1e-6)
            torch.testing.assert_close(a, torch.softmax(-temperature * z, 0))
        assert int(a.argmax()) == int(evidence.argmax())


def test_structure_scores_read_each_box_and_the_rest(probe) -> None:
    model = _model()
    x = torch.rand(1, 3, 128, 128)
    s = model.stride
    boxes = [{"kind": "lesion", "y0": 0, "y1": 2 * s, "x0": 0, "x1": 2 * s},
             {"kind": "distractor", "y0": 4 * s, "y1": 5 * s, "x0": 4 * s, "x1": 6 * s}]  # fmt: skip
    with torch.no_grad():
        found = probe.structure_scores(model, x, boxes)
        hs = model[:3](x)
    score = hs[0, -1]
    assert found["lesion score"] == [float(score[:2, :2].max())]
    assert found["look-alike score"] == [float(score[4:5, 4:6].max())]
    rest = torch.ones_like(score, dtype=torch.bool)
    rest[:2, :2] = rest[4:5, 4:6] = False
    assert found["background score p99"] == [float(torch.quantile(score[rest], 0.99))]
    assert set(found) == {f"{k} {m}" for k in ("lesion", "look-alike") for m in ("score", "evidence")} | {
        "background score p99", "background evidence p99"}


def test_train_split_is_stratified_and_seeded(probe) -> None:
    import numpy as np

    ys = [1, 0] * 10
    a = probe.train_split(ys, 8, np.random.default_rng(3))
    assert a == probe.train_split(ys, 8, np.random.default_rng(3)) and len(set(a)) == 8
    assert sum(ys[i] for i in a) == 4


def test_channel_max_pool_is_max_pooling_on_the_attention_model_s_map(probe) -> None:
    model = _model()
    model.pool = probe.ChannelMaxPool(model.classifier)
    x = torch.rand(1, 3, 96, 64)
    with torch.no_grad():
        hs = model[:3](x)
        torch.testing.assert_close(model(x), model.classifier(hs[:, :-1].amax((2, 3))))
        # its logged weights are the max-instance head's, which takes over from it
        torch.testing.assert_close(model.pool.weights(hs), probe.EvidencePool(model.classifier, 0.0).weights(hs))


@pytest.mark.parametrize("tied", [False, True])
def test_max_plus_instance_adds_the_top_cell_logit_to_the_positive_class(probe, tied: bool) -> None:
    model = _model()
    linear = model.classifier
    model.pool = probe.MaxPlusInstancePool(model.attention.out_channels, linear, tied=tied)
    model.classifier = probe.MixedClassifier(linear)
    x = torch.rand(1, 3, 80, 112)
    with torch.no_grad():
        hs = model[:3](x)
        f = hs[:, :-1]  # (1, C, h, w)
        if tied:
            e = torch.einsum("c,bchw->bhw", linear.weight[1] - linear.weight[0], f)[:, None]
        else:
            e = model.pool.instance(f)
        want = linear(f.amax((2, 3))) + torch.stack([torch.zeros(1), e.amax((1, 2, 3))], 1)
        torch.testing.assert_close(model(x), want)
        a = model.pool.weights(hs).flatten()
        assert a.sum() == 1 and a[e.flatten().argmax()] == 1  # the pointing map: the branch's top cell


@pytest.mark.parametrize(("k", "mix"), [(1, 0.0), (1, 0.4), (1, 1.0), (16, 1.0)])
def test_ramp_mixes_max_pooling_and_the_top_cells_evidence(probe, k: int, mix: float) -> None:
    model = _model()
    linear = model.classifier
    model.pool = probe.MaxToEvidencePool(linear, k)
    model.classifier = probe.RampClassifier(linear, mix)
    x = torch.rand(1, 3, 96, 96)
    with torch.no_grad():
        hs = model[:3](x)
        f = hs[:, :-1]
        e = torch.einsum("c,bchw->bhw", linear.weight[1] - linear.weight[0], f).flatten(1)  # (1, N)
        top = e.topk(k, 1).values.mean(1)
        instance = linear.bias + torch.stack([torch.zeros_like(top), top], 1)
        torch.testing.assert_close(model(x), (1 - mix) * linear(f.amax((2, 3))) + mix * instance)
        a = model.pool.weights(hs).flatten()
        torch.testing.assert_close(a.sum(), torch.tensor(1.0))
        assert set(a.nonzero().flatten().tolist()) == set(e[0].topk(k).indices.tolist())


def test_non_negative_classifier_lets_features_raise_the_positive_class_only(probe) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 2)
    head = probe.NonNegativeClassifier(linear)
    z = torch.rand(3, 6)
    d = (linear.weight[1] - linear.weight[0]).abs()
    want = torch.stack([torch.zeros(3), z @ d + linear.bias[1] - linear.bias[0]], 1)
    torch.testing.assert_close(head(z), want)
    torch.testing.assert_close(head.weight, torch.stack([torch.zeros(6), d]))
    more = z + torch.rand(3, 6)  # more of any feature never lowers the positive class's logit
    assert bool((head(more)[:, 1] >= head(z)[:, 1]).all())


def test_score_mil_loss_on_a_negative_slide_pushes_its_k_highest_scores_down(probe) -> None:
    model = _model()
    x = torch.rand(1, 3, 128, 160)
    _, aux = probe.score_mil_loss(model, x, 0, neg_k=5)
    s = model[:3](x)[:, -1].flatten(1)  # (1, N)
    top5 = s.sort(1, descending=True).values[:, :5]
    torch.testing.assert_close(aux, F.binary_cross_entropy_with_logits(top5, torch.zeros_like(top5)))
    _, pos = probe.score_mil_loss(model, x, 1, neg_k=5)  # a positive slide still reads its top score only
    torch.testing.assert_close(pos, F.binary_cross_entropy_with_logits(s.amax(1), torch.ones(1)))


def test_sharp_attention_is_the_softmax_of_the_scaled_scores(probe) -> None:
    model = _model()
    hs = model[:3](torch.rand(1, 3, 96, 128))  # (1, C + 1, h, w)
    a = probe.SharpAttentionPool(4.0).weights(hs)
    ref = torch.softmax(4.0 * hs[:, -1].flatten(1), 1).view_as(a)
    torch.testing.assert_close(a, ref)
    z = probe.SharpAttentionPool(4.0)(hs)  # (1, 1, C): the same weights pool the features
    torch.testing.assert_close(z[0, 0], (ref[0, 0, :, :, None] * hs[0, :-1].permute(1, 2, 0)).sum((0, 1)))


def test_refit_fits_the_classifier_alone_as_the_max_instance_head(probe) -> None:
    model = _model()
    images = [(torch.rand(1, 3, 96, 96) * 255).to(torch.uint8) for _ in range(4)]
    trunk = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("classifier")}
    before = model.classifier.weight.detach().clone()
    fit = probe.refit_max_instance(model, images, [0, 1, 0, 1], [0, 1, 2, 3], 1e-2, np.random.default_rng(0), steps=20)
    assert set(fit) == {"refit_first100_loss", "refit_last100_loss"}
    assert not torch.equal(model.classifier.weight, before)  # the classifier moved
    for k, v in model.state_dict().items():  # nothing else did
        if k in trunk:
            assert torch.equal(v, trunk[k]), k


def test_the_instance_losses_read_the_positive_branch_on_the_tissue_only(probe) -> None:
    model = probe.make_model("attention", "mb_score_mil_lme", 0).eval()  # one branch per class, a learnt bias
    x = torch.rand(1, 3, 128, 128)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[0, 0, 2:4, 1:4] = True  # 6 cells
    probe.set_mask(model, [mask], 0, quarter_turns=1)  # turned with the image, as in training
    turned = torch.rot90(mask, 1, (2, 3))
    s = model[:3](x)[0, -1][turned[0, 0]]  # the positive class's branch, on the kept cells
    _, lme = probe.score_lme_loss(model, x, 1)
    want = torch.logsumexp(s, 0) - np.log(6) + model.instance_bias
    torch.testing.assert_close(lme, F.binary_cross_entropy_with_logits(want, torch.tensor(1.0)))
    _, neg = probe.score_mil_loss(model, x, 0, neg_k=64)  # 64 asked, 6 kept
    top = s.sort(descending=True).values
    torch.testing.assert_close(neg, F.binary_cross_entropy_with_logits(top, torch.zeros_like(top)))
    _, pos = probe.score_mil_loss(model, x, 1, pos_k=2)
    torch.testing.assert_close(pos, F.binary_cross_entropy_with_logits(top[:2], torch.ones(2)))
