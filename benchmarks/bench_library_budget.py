"""Does the budget hold for a library user? ``SFT`` in a fresh process that wsitrain does not own, on CPU.

A new user writes ``SFT(model, memory_budget=...)`` in their own script: nothing calls
``wsitrain.memory.tune_cpu_allocator`` for them. Each configuration runs in a fresh Python process, as that
user's would: plain PyTorch (the reference peak), then SFT with the budget at ``--share`` of plain's peak,
once with glibc's allocator left alone (``WSITRAIN_CPU_ALLOCATOR=default``) and once as the library behaves by
default (it tunes the allocator at first use and says so once). Two steps (a warm-up and a measured one).
"peak" is what the user's process holds at its highest, over both steps: its peak resident memory minus the
interpreter's with torch and the model's library imported (their code pages are not training memory; measured
165 MiB for torchvision, which an earlier version of this script counted as the step's). "step" is the measured
step alone: its resident high-water mark (VmHWM reset before it) above the memory before it, plus the model and
the image (the budget covers them); heap the first step left resident is not in it.

    python benchmarks/bench_library_budget.py                    # VGG-16, 1024 px, 35% of plain
    python benchmarks/bench_library_budget.py --model tiny --size 2048 --share 0.35
    python benchmarks/bench_library_budget.py --snippet --before /tmp/old-checkout   # issue 55's table, before/after

``--snippet`` runs issue 55's snippet (tiny, a uint8 image, 512 MiB, one step in a fresh process, planning inside it)
at 4096, 8192 and 12288 px and prints a markdown table: the issue's measure (VmHWM minus VmRSS just before the
step), that plus the image and the parameters (what the budget covers on CPU), the plan, or the refusal. ``--before``
runs the same snippet on an older source tree as well (its folder first on PYTHONPATH), for the before/after table
of docs/benchmarks/library-budget-cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WORKER = r"""
import json, logging, sys, time, torch
from wsitrain.memory import PeakMeter, current_rss_bytes, peak_rss_bytes
from wsitrain.models import build
from wsitrain.sft import SFT
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
name, size, mode, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with torch.device("meta"):
    build(name, 2)  # imports the model's library (torchvision: 165 MiB of code and data pages, measured)
rss0 = current_rss_bytes()  # the interpreter with its libraries imported: not the user's training
torch.manual_seed(0)
model = build(name, 2)
x = torch.randn(1, 3, size, size)
net = SFT(model, memory_budget=int(budget)) if mode == "sft" else model
static = sum(p.numel() * p.element_size() for p in model.parameters()) + x.numel() * x.element_size()
def step():
    model.zero_grad(set_to_none=True)
    net(x).float().pow(2).mean().backward()
step()  # warm-up: thread pools, kernel caches, the plan
meter = PeakMeter("cpu")
model.zero_grad(set_to_none=True)
base = meter.current()
meter.start()
t0 = time.perf_counter()
net(x).float().pow(2).mean().backward()
s = time.perf_counter() - t0
planned = net.plan_for(tuple(x.shape)).estimated_peak_bytes if mode == "sft" else None
step_peak = max(0, meter.peak() - base) + static
print(json.dumps({"peak": peak_rss_bytes() - rss0, "step_peak": step_peak, "seconds": s, "planned": planned}))
"""


PAGE = "docs/engine/background.md (the library's budget)"  # named in --help


def run(model: str, size: int, mode: str, budget: int, allocator: str | None) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("WSITRAIN_CPU_ALLOCATOR", None)
    if allocator is not None:
        env["WSITRAIN_CPU_ALLOCATOR"] = allocator
    out = subprocess.run(
        [sys.executable, "-c", WORKER, model, str(size), mode, str(budget)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    said = [line for line in out.stderr.splitlines() if "WARNING" in line]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["said"] = said
    return result


SNIPPET = r"""
import json, sys, torch
import torch.nn.functional as F
from wsitrain.errors import PlanError
from wsitrain.models import build
from wsitrain.sft import SFT
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
size, budget = int(sys.argv[1]), int(sys.argv[2])
x = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8)
model = build("tiny", num_classes=2)
net = SFT(model, memory_budget=budget)
static = x.numel() * x.element_size() + sum(p.numel() * p.element_size() for p in model.parameters())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
try:
    F.cross_entropy(net(x), torch.tensor([1])).backward()
except PlanError as e:
    print(json.dumps({"refused": e.message}))
    sys.exit(0)
p = net.plan_of(x)
print(json.dumps({"issue": status("VmHWM") - before, "static": static, "planned": p.estimated_peak_bytes,
                  "brief": p.brief, "image_inside": p.segments[0].checkpoint_location == "device"}))
"""
SNIPPET_SIZES = (4096, 8192, 12288)


def snippet(size: int, budget: int, source: str | None) -> dict[str, object]:
    """Issue 55's snippet at ``size`` in a fresh process, on ``source`` (a source tree) or this checkout."""
    env = dict(os.environ)
    env.pop("WSITRAIN_CPU_ALLOCATOR", None)
    if source is not None:  # run from its folder too: ``python -c`` puts the working folder first on sys.path
        env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", SNIPPET, str(size), str(budget)], capture_output=True, text=True,
                         env=env, check=True, cwd=source)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def snippet_table(before: str | None) -> None:
    import torch  # only for the version in the caption

    mib, budget = 2**20, 512 * 2**20
    runs = [("before", before), ("after", None)] if before else [("this checkout", None)]
    print(f"measured on this {os.cpu_count()}-core CPU, torch {torch.__version__}, tiny, uint8 image, 512 MiB budget\n")
    print("| code | size | issue's measure (MiB) | + image and weights (MiB) | planned (MiB) | plan |")
    print("|---|---|---|---|---|---|")
    for label, source in runs:
        for size in SNIPPET_SIZES:
            r = snippet(size, budget, source)
            if "refused" in r:
                print(f"| {label} | {size} | - | - | - | refused: {r['refused']} |")
                continue
            issue, static, planned = (float(r[k]) / mib for k in ("issue", "static", "planned"))  # type: ignore[arg-type]
            where = "inside" if r["image_inside"] else "outside (host)"
            print(f"| {label} | {size} | {issue:.0f} | {issue + static:.0f} | {planned:.1f} (image {where}) | "
                  f"{r['brief']} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="vgg16")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--share", type=float, default=0.35, help="budget as a share of plain PyTorch's measured peak")
    ap.add_argument("--snippet", action="store_true", help="issue 55's snippet at 4096, 8192 and 12288 px instead")
    ap.add_argument("--before", default=None, help="with --snippet: an older source tree to measure as well")
    args = ap.parse_args()
    if args.snippet:
        snippet_table(args.before)
        return
    mib = 2**20
    plain = run(args.model, args.size, "plain", 0, "default")
    budget = int(args.share * plain["peak"])
    print(f"{args.model} at {args.size} px, fresh processes, CPU, {os.cpu_count()} cores")
    print(
        f"plain PyTorch (default allocator): peak {plain['peak'] / mib:.0f} MiB (step {plain['step_peak'] / mib:.0f} "
        f"MiB), {plain['seconds']:.1f} s"
    )
    print(f"budget: {args.share:.0%} of plain = {budget / mib:.0f} MiB")
    for label, allocator in (("SFT, allocator left alone", "default"), ("SFT as a library (tunes at first use)", None)):
        r = run(args.model, args.size, "sft", budget, allocator)
        verdict = "holds" if r["peak"] <= budget else "EXCEEDED"
        print(
            f"{label}: peak {r['peak'] / mib:.0f} MiB = {r['peak'] / plain['peak']:.0%} of plain (step "
            f"{r['step_peak'] / mib:.0f} MiB, planned {r['planned'] / mib:.0f} MiB), {r['seconds']:.1f} s; "
            f"budget {verdict}"
        )
        for line in r["said"]:
            print(f"    said: {line}")


if __name__ == "__main__":
    main()
