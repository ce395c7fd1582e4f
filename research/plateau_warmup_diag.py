"""Why a head warm-up that did not learn flattens the run (docs/research/plateau.md section 6): one seed, whole slides.

    PYTHONPATH=$PWD python research/plateau_warmup_diag.py --cohort C --seed 1

Builds the probe's attention model (research/plateau_probe.py, same split and init), runs ``train.head_warmup``'s
function without its keep rule, then 24 end-to-end AdamW steps, and prints the trunk's share of active (> 0) features,
their spread over positions, the largest attention weight and the classifier's largest weight along the way. Every
figure it prints is *measured* on the machine that runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import plateau_probe as pp  # noqa: E402

from wsitrain.train import head_warmup  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/lesions/n16-s1024"))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    images, ys, _, _ = pp.load_cohort(args.cohort, 16, 1024)
    rng = np.random.default_rng(args.seed)
    pos = [i for i, y in enumerate(ys) if y]
    neg = [i for i, y in enumerate(ys) if not y]
    train = sorted(rng.permutation(pos)[:4].tolist() + rng.permutation(neg)[:4].tolist())  # as plateau_probe.run
    model = pp.make_model("attention", "head_warmup_patch", args.seed)
    pp.trunk_stats(model, images[train[0]])  # as the probe: same RNG use before training
    x0 = images[train[0]].float() / 255

    def show(tag: str) -> None:
        with torch.no_grad():
            f = model.features(model.normalize(x0))  # (1, C, h, w)
            a = model.pool.weights(model.attention(f))  # (1, 1, h, w)
        print(f"{tag}: active features {float((f > 0).float().mean()):.3f}, spread over positions "
              f"{float(f.std(dim=(2, 3)).mean()):.4f}, largest attention weight {float(a.max()):.5f}, "
              f"classifier max |w| {float(model.classifier.weight.abs().max()):.3f}", flush=True)  # fmt: skip

    show("init")
    head_warmup.MIN_GAIN = -1.0  # keep whatever it learnt: what the probe's head_warmup_patch did before the rule
    res = head_warmup.warm_up_head(model, [images[i] for i in train], [ys[i] for i in train], steps=2000, patch=64,
                                   lr=1e-3, seed=args.seed)  # fmt: skip
    print(f"warm-up loss {res.first_loss:.4f} -> {res.last_loss:.4f} (prior {res.prior_loss:.4f})")
    show("after the warm-up")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(24):
        i = train[k % len(train)]
        x = torch.rot90(images[i].float() / 255, int(rng.integers(4)), (2, 3))
        loss = F.cross_entropy(model(x), torch.tensor([ys[i]]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if k % 4 == 0:
            show(f"end-to-end step {k}, loss {float(loss):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
