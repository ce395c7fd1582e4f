"""The budget is a promise on a CPU too: ``SFT`` used as a library, in a fresh process, within its budget (issue 55).

On CPU host and device memory are one RAM: the image (uint8 or float) is inside the budget, as segment 0's
checkpoint. Each case runs in a fresh process as a library user's script would: the model built and the image
allocated, then ``SFT(model, memory_budget=...)`` and training steps. "Measured" is what the budget covers: the
step's resident high-water mark (VmHWM, reset before it) above the memory before it, plus the image and the
parameters, which were allocated before. The first step of a process also pages in code and compiles oneDNN's
kernels for the tiles' shapes (measured 39-44 MiB left resident after it, tiny at 1024-3072 px; not in the plan): the
small cases check the steady step, the issue's 512 MiB cases the first one as its snippet measures it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

MiB = 2**20

WORKER = r"""
import json, sys, torch
import torch.nn.functional as F
from wsitrain.models import build
from wsitrain.sft import SFT
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
classes, size, dtype, budget, steps = (int(a) if a.isdigit() else a for a in sys.argv[1:6])
torch.manual_seed(0)
model = build("tiny", num_classes=classes)
shape = (1, 3, size, size)
x = torch.randint(0, 256, shape, dtype=torch.uint8) if dtype == "uint8" else torch.rand(shape)
net = SFT(model, memory_budget=budget)
static = x.numel() * x.element_size() + sum(p.numel() * p.element_size() for p in model.parameters())
peaks = []
for _ in range(steps):
    model.zero_grad(set_to_none=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts at the memory now
    before = status("VmRSS")
    F.cross_entropy(net(x), torch.tensor([1])).backward()
    peaks.append(status("VmHWM") - before + static)
p = net.plan_of(x)
print(json.dumps({"peaks": peaks, "planned": p.estimated_peak_bytes, "brief": p.brief,
                  "recomputed": net.last_stats.recomputed_tiles, "image_inside": not p.input_on_host}))
"""


def measure(classes: int, size: int, dtype: str, budget: int, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WSITRAIN_CPU_ALLOCATOR", None)  # as a library user's process: the engine tunes glibc at first use
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(classes), str(size), dtype, str(budget), str(steps)],
        capture_output=True, text=True, timeout=1200, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


# (classes, size, image dtype, budget): two classes plan one pass, three recompute (no head direction known in
# forward); a float image is inside the budget at 4 bytes a pixel
@pytest.mark.parametrize(
    ("classes", "size", "dtype", "budget"),
    [(3, 1024, "uint8", 32 * MiB), (2, 1024, "float32", 40 * MiB), (2, 1536, "uint8", 48 * MiB)],
)
def test_a_steady_cpu_step_stays_within_the_budget(classes: int, size: int, dtype: str, budget: int) -> None:
    m = measure(classes, size, dtype, budget, steps=2)
    assert m["image_inside"] and "tiled" in m["brief"], m
    if classes == 3:
        assert m["recomputed"] > 0, m  # the recompute path, not one pass
    assert m["peaks"][1] <= budget, {**m, "budget": budget}


# The issue's size only: a 4096 px case beside it (17-29 s on CI's cores, measured) ran the same path, one plan and one
# step in a fresh process, that the 8192 px case and the steady-step cases above already hold to their budgets.
@pytest.mark.heavy
def test_the_issues_snippet_holds_its_budget_in_the_first_step() -> None:
    """The issue's snippet as it measured it (one step in a fresh process, planning inside it): before, 680 MiB at
    8192 px for 512 MiB; now within the budget with the image counted (8192 px: 51-56 s on CI's cores, measured)."""
    m = measure(2, 8192, "uint8", 512 * MiB, steps=1)
    assert m["image_inside"] and m["peaks"][0] <= 512 * MiB, m


def test_a_cpu_plan_counts_the_image_and_refuses_with_the_least_budget_as_wsitrain_plan_does() -> None:
    """12288 px in 512 MiB: the uint8 image alone is 432 MiB. The library refuses naming the least budget that fits,
    and ``wsitrain plan`` says the same, for uint8 and float32 images alike (both with AdamW: the CLI plans fit's)."""
    from wsitrain.errors import PlanError
    from wsitrain.models import build
    from wsitrain.plan.command import make_plan
    from wsitrain.sft import SFT
    from wsitrain.units import format_bytes

    cases = [(12288, torch.uint8), (8192, torch.uint8), (8192, torch.float32)]
    fits = []
    for size, dtype in cases:
        name = str(dtype).removeprefix("torch.")
        cli = make_plan(model="tiny", size=str(size), gpu=None, memory="512MiB", with_max_size=False, input_dtype=name)
        fits.append(cli.plan.fits)
        net = SFT(build("tiny", 2), memory_budget="512MiB", optimizer="adamw")
        shape = (1, 3, size, size)
        if not cli.plan.fits:  # the library refuses too, naming the same least budget
            with pytest.raises(PlanError) as err:
                net.plan_for(shape, input_dtype=dtype)  # as plan_of plans such an image on CPU
            least = cli.plan.min_budget_bytes
            assert least is not None and "image" in cli.plan.notes[0], cli.plan.notes
            assert f"at least {format_bytes(least)}" in err.value.message and "at least" in (err.value.hint or "")
            continue
        lib = net.plan_for(shape, input_dtype=dtype)
        placed = {"host_budget_bytes"}  # the command places host memory by this node's RAM; nothing is on the host
        lib_d = {k: v for k, v in lib.to_dict().items() if k not in placed}
        assert lib_d == {k: v for k, v in cli.plan.to_dict().items() if k not in placed}, (size, name)
        assert not lib.input_on_host and lib.segments[0].checkpoint_bytes == size * size * 3 * dtype.itemsize
    assert fits == [False, True, False]  # the uint8 image fits at 8192 px, the float one (768 MiB) does not
