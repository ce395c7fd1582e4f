"""scripts/plateau_probe.py's measuring pieces: the pointing game it logs and the max-instance score loss it tries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from script_module import load_script

from wsitrain.models import zoo


@pytest.fixture(scope="module")
def probe():
    return load_script("plateau_probe")


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
