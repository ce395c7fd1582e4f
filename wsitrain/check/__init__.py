"""``wsitrain check-model``: does the SFT engine run a model exactly?

The model (a built-in, ``torchvision/<name>``, ``timm/<name>`` or a Python ``module:function``) gets random
weights in float64 and runs one training step twice, with plain autograd and with SFT, under forced small tiles
and under a budget-driven plan; each check is ``exact``, ``refused`` (the engine's PlanError) or ``wrong``.
"""

from wsitrain.check.compare import CheckResult, TensorError
from wsitrain.check.models import load_model, parse_size
from wsitrain.check.run import ModelCheck, check_model

__all__ = ["CheckResult", "ModelCheck", "TensorError", "check_model", "load_model", "parse_size"]
