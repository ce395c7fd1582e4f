"""The model zoo: `wsitrain check-model` over timm and torchvision CNN families, smallest variant of each.

Each family is exact (float64, random weights, against plain autograd) or refused with a clear message naming the
layer. Nothing may end in an internal error.

Exact means within max(1e-12, 100x the model's own rounding noise: plain against plain on the image moved by one
ulp; see wsitrain/check/compare.py). With random weights EfficientNetV2 and FBNetV3 are ill-conditioned (one ulp
moves plain's own gradients by 1e-10 to 2e-9, the same tensors the engine's errors of 2e-10 to 4e-9 are worst on);
with frozen statistics scaled to the input both are exact below 1e-12 (tests/test_sft_multipass_regressions.py).

Sizes are tiny so the zoo runs in minutes on one core: 1 x 3 x 64 x 96 (non-square: a swapped axis shows) with
tiles forced to 16 px (every segment tiled; deep segments get tiles of 2 output pixels), BatchNorm in eval mode.
A few families also run the budget-driven plan and train-mode BatchNorm (the multi-pass sweeps). The families over
about 5 s on one core of CI's 2 are marked heavy: CI runs them (`make test-heavy`), `make test` does not.
`python -m pytest tests/test_model_zoo.py --junitxml=zoo.xml` records each family's verdict, worst error and seconds
as properties.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest

from wsitrain.check import check_model
from wsitrain.check.compare import ERROR, EXACT, REFUSED

pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")

TILE = 16


@dataclass(frozen=True)
class Family:
    name: str
    size: tuple[int, int] = (64, 96)
    checks: tuple[str, ...] = ("tiles",)
    train_bn: bool = False
    batch: int = 1
    refused: str | None = None  # what the refusal must say (a regex: the layer and why)
    heavy: bool = False  # 5-55 s each on CI's cores (measured, --junitxml): CI runs it, `make test` does not

    @property
    def id(self) -> str:
        extra = [c for c in self.checks if c != "tiles"] + (["train_bn"] if self.train_bn else [])
        return "-".join([self.name, *extra])


FAMILIES = [
    # timm: residual, grouped, squeeze-excitation, dense, dual-path, aggregation trees, multi-branch
    Family("timm/resnet10t"),
    Family("timm/resnet10t", checks=("tiles", "budget"), train_bn=True, batch=2),  # train BatchNorm: sweeps
    Family("timm/resnext26ts"),
    Family("timm/seresnet18"),
    Family("timm/resnetv2_18"),
    Family("timm/resnest14d"),
    Family("timm/resnest14d", train_bn=True, batch=2),
    Family("timm/skresnet18"),
    Family("timm/res2net50_14w_8s", heavy=True),
    Family("timm/densenet121"),
    Family("timm/dpn48b"),
    Family("timm/dla34"),
    Family("timm/dla34", checks=("budget",)),
    Family("timm/dla46_c"),
    Family("timm/hrnet_w18_small"),
    Family("timm/selecsls42b", size=(192, 128), heavy=True),  # stride 64 and cut points only at both ends
    Family("timm/xception41", heavy=True),
    Family("timm/inception_v3", size=(128, 160)),  # valid convolutions: 2 x 3 at the end
    Family("timm/tresnet_m", heavy=True),
    # timm: mobile and NAS families (depthwise, squeeze-excitation in multi-pass sweeps, hard-swish)
    Family("timm/efficientnet_b0", heavy=True),
    Family("timm/tinynet_e"),
    Family("timm/mobilenetv2_050"),
    Family("timm/mobilenetv3_small_050"),
    Family("timm/mobilenetv3_small_050", checks=("budget",), heavy=True),
    Family("timm/mobilenetv4_conv_small"),
    Family("timm/mnasnet_small"),
    Family("timm/hardcorenas_a"),
    Family("timm/mixnet_s", heavy=True),
    Family("timm/lcnet_050"),
    Family("timm/ghostnet_050"),
    Family("timm/rexnet_100"),
    Family("timm/regnetx_002"),
    Family("timm/regnety_002"),
    Family("timm/efficientnetv2_rw_t", heavy=True),
    Family("timm/fbnetv3_b", heavy=True),
    # timm: plain, CSP and darknet stacks, re-parameterizable and normalizer-free nets
    Family("timm/repvgg_a0"),
    Family("timm/gernet_s"),
    Family("timm/ese_vovnet19b_dw"),
    Family("timm/cspresnet50"),
    Family("timm/cs3darknet_s"),
    Family("timm/darknet17"),
    Family("timm/nf_regnet_b0"),
    # timm: ConvNeXt and its relatives (LayerNorm over channels, GRN, channel attention, star blocks)
    Family("timm/convnext_atto"),
    Family("timm/convnextv2_atto"),
    Family("timm/convnextv2_atto", checks=("budget",), heavy=True),
    Family("timm/inception_next_atto"),
    Family("timm/edgenext_xx_small"),
    Family("timm/starnet_s050"),
    # refused, by name and reason: attention over positions (legitimate), and layers the engine cannot tile yet
    Family("timm/mobilevit_xxs", refused=r"layer features\.stages\.2\.1 \(MobileVitBlock\).*control flow"),
    Family("timm/hgnetv2_b0"),  # F.pad right and bottom in the stem
    Family("timm/ghostnetv2_100"),  # attention gate resized to out.shape: 2x on even maps (64 x 96: 2 x 3 at the end)
    # 4 x 5 at stride 32, pooled to 2 x 2 and resized back: floor(o * 2 / 5), tiled with global indices (stretch.py)
    Family("timm/ghostnetv2_100", size=(128, 160), heavy=True),
    # torchvision
    Family("torchvision/vgg11"),
    Family("torchvision/alexnet", size=(128, 160)),
    Family("torchvision/squeezenet1_1"),
    Family("torchvision/googlenet"),
    Family("torchvision/inception_v3", size=(128, 160)),
    Family("torchvision/shufflenet_v2_x0_5"),
    Family("torchvision/mobilenet_v3_small"),
    Family("torchvision/mnasnet0_5"),
    Family("torchvision/regnet_x_400mf"),
    Family("torchvision/convnext_tiny", heavy=True),
]


def _param(f: Family) -> object:
    marks = [pytest.mark.heavy] if f.heavy else []
    return pytest.param(f, id=f.id, marks=marks)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.filterwarnings("ignore:The default weight initialization")
@pytest.mark.parametrize("family", [_param(f) for f in FAMILIES])
def test_family(family: Family, record_property: pytest.RecordProperty) -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    result = check_model(family.name, family.size, family.batch, family.train_bn, TILE, checks=family.checks)
    lines = "\n".join(r.line() for r in result.results)
    record_property("verdict", result.verdict)
    record_property("worst_error", result.worst_error)
    record_property("seconds", round(time.perf_counter() - t0, 2))
    record_property("cpu_seconds", round(time.process_time() - c0, 2))
    record_property("lines", lines)
    if any(r.verdict == ERROR for r in result.results):
        pytest.fail(f"internal error (a bug to report):\n{lines}")
    if family.refused:
        if not all(r.verdict == REFUSED and re.search(family.refused, r.message) for r in result.results):
            pytest.fail(f"must be refused, saying {family.refused!r}:\n{lines}")
        return
    if not all(r.verdict == EXACT for r in result.results):
        pytest.fail(f"wrong beyond the model's own rounding noise:\n{lines}")
    tiles = [r for r in result.results if r.check == "tiles"]
    if not all(r.tiles > r.tiled_segments >= 1 for r in tiles):
        pytest.fail(f"forced tiles must really tile:\n{lines}")
