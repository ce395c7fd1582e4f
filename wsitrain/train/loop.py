"""One slide through the engine: forward only (``Evaluator``), or forward + backward and optimizer steps (``Trainer``).

A "batch" is one slide (slides differ in shape); ``train.accumulate`` slides make one optimizer step, each slide's
loss scaled by 1/(slides in that window) so the step equals the mean gradient over the window.

Each step measures its own peak memory with ``PeakMeter``: ``start()`` before the step, ``peak()`` after. The step
is the owner of that measurement; nothing else resets the meter's counter.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from wsitrain.memory import PeakMeter
from wsitrain.precision import autocast_dtype
from wsitrain.sft import SFT, StepStats
from wsitrain.tasks.objective import Objective
from wsitrain.train.distributed import DistInfo, allreduce_gradients
from wsitrain.train.instance_loss import Capture, InstanceLoss
from wsitrain.train.optim import compute_loss, probabilities


@dataclass
class SlideStep:
    """What one slide's forward (+ backward) produced and cost."""

    loss: float
    probs: torch.Tensor  # (C,) float32 on the host: class probabilities, or the task's outputs (Objective.outputs)
    forward_s: float
    backward_s: float
    peak_bytes: int  # PeakMeter's peak over the step: CUDA allocated bytes, CPU resident memory
    stats: StepStats  # the engine's per-tile timings of this step


def as_batch(image: torch.Tensor) -> torch.Tensor:
    return image.unsqueeze(0) if image.dim() == 3 else image  # (3, H, W) -> (1, 3, H, W)


class Evaluator:
    """Forward passes of the engine-wrapped model in the run's precision: validation and prediction."""

    def __init__(self, model: SFT, *, device: torch.device, precision: str = "fp32",
                 loss: str = "cross_entropy", objective: Objective | None = None) -> None:  # fmt: skip
        self.model = model
        self.device = device
        self.precision = precision
        self.loss_name = loss
        self.objective = objective  # a task's loss and outputs; None: classification with train.loss
        self.meter = PeakMeter(device)
        self._autocast_dtype = autocast_dtype(precision)

    @property
    def activation_dtype(self) -> torch.dtype | None:
        """The autocast dtype of the run's precision; None in fp32 (activations in the parameters' dtype)."""
        return self._autocast_dtype

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self._autocast_dtype is not None:
            return torch.autocast(self.device.type, dtype=self._autocast_dtype)
        return contextlib.nullcontext()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _loss(self, logits: torch.Tensor, label: int | torch.Tensor) -> torch.Tensor:
        """A class index goes to train.loss; a task's target tensor (Objective.target) to the task's loss."""
        if isinstance(label, torch.Tensor):
            assert self.objective is not None, "a target tensor needs the task's objective"
            return self.objective.loss(logits, label.to(logits.device))
        target = torch.tensor([label], dtype=torch.long, device=logits.device)
        return compute_loss(logits, target, self.loss_name)

    def _outputs(self, logits: torch.Tensor) -> torch.Tensor:
        if self.objective is not None:
            return self.objective.outputs(logits.detach())
        return probabilities(logits, self.loss_name)

    @torch.no_grad()
    def eval_slide(self, image: torch.Tensor, label: int | torch.Tensor | None) -> SlideStep:
        """Forward only (no graph kept): loss against ``label`` when given, and class probabilities."""
        self.model.eval()
        x = as_batch(image)
        self.meter.start()
        t0 = time.perf_counter()
        with self.autocast():
            logits = self.model(x)
        loss = float("nan")
        if label is not None:
            loss = float(self._loss(logits, label))
        self._sync()
        t1 = time.perf_counter()
        probs = self._outputs(logits)[0].cpu()
        return SlideStep(loss, probs, t1 - t0, 0.0, self.meter.peak(), self.model.last_stats)


class Trainer(Evaluator):
    """An Evaluator that also trains: optimizer, schedule, gradient scaler, clipping and gradient averaging."""

    def __init__(
        self,
        model: SFT,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        device: torch.device,
        precision: str = "fp32",
        loss: str = "cross_entropy",
        clip_grad_norm: float | None = None,
        dist: DistInfo | None = None,
        bucket_mb: float = 25.0,
        objective: Objective | None = None,
        instance: InstanceLoss | None = None,
    ) -> None:
        super().__init__(model, device=device, precision=precision, loss=loss, objective=objective)
        self.instance = instance  # model.attention.instance_loss, added to each slide's loss in training
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip_grad_norm = clip_grad_norm
        self.dist = dist or DistInfo()
        self.bucket_mb = bucket_mb
        # fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none.
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    def train_slide(self, image: torch.Tensor, label: int | torch.Tensor, scale: float) -> SlideStep:
        """Forward + backward of one slide; gradients accumulate into .grad (scaled by ``scale``).

        ``label``: a class index, or a task's target tensor (``Objective.target``). The step's ``loss`` is the
        slide's own; with model.attention.instance_loss the backward also takes that loss, times its weight."""
        self.model.train()
        x = as_batch(image)
        self.meter.start()
        t0 = time.perf_counter()
        with self.autocast(), self._captured() as cap:
            logits = self.model(x)
        loss = self._loss(logits, label)
        total = loss
        if self.instance is not None:
            assert cap is not None and isinstance(label, int)
            total = loss + self.instance.spec.weight * self.instance(cap, label)
        self._sync()
        t1 = time.perf_counter()
        self.scaler.scale(total * scale).backward()
        self._sync()
        t2 = time.perf_counter()
        probs = self._outputs(logits.detach())[0].cpu()
        return SlideStep(float(loss.detach()), probs, t1 - t0, t2 - t1, self.meter.peak(), self.model.last_stats)

    def _captured(self) -> contextlib.AbstractContextManager[Capture | None]:
        """The instance loss's capture of the pooled output, when the run has one."""
        return self.instance.captured() if self.instance is not None else contextlib.nullcontext()

    def optimizer_step(self) -> OptimizerStep:
        """Average gradients over ranks, unscale, clip, step, advance the schedule; returns timing and norm."""
        t0 = time.perf_counter()
        allreduce_gradients(self.params, self.dist, self.bucket_mb)
        grad_norm = None
        if self.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the fp16-scaled ones
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm))
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # fp16: the scaler skips the first steps while it finds its scale (inf gradients); the schedule
            # still advances, as intended, and torch's "scheduler before optimizer" warning is noise here.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self._sync()
        return OptimizerStep(time.perf_counter() - t0, grad_norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


@dataclass(frozen=True)
class OptimizerStep:
    """Time and gradient norm of one optimizer step (norm only with train.clip_grad_norm)."""

    seconds: float
    grad_norm: float | None
