"""The simulated device: one training step of the real executor on fake tensors, counting live storages.

from wsitrain.sft.simulate import simulate_step
with torch.device("meta"):
    model = build("vgg16", 2)
s = simulate_step(model, (1, 3, 20480, 20480), "11GiB")
print(simulation_text(s))     # simulated device and host peaks, where, next to the plan's replay and estimate
"""

from wsitrain.sft.simulate.report import NOT_SIMULATED, simulation_dict, simulation_text
from wsitrain.sft.simulate.runtime import SimRuntime, StreamOrderError
from wsitrain.sft.simulate.step import SimulatedStep, simulate_step

__all__ = [
    "NOT_SIMULATED",
    "SimRuntime",
    "SimulatedStep",
    "StreamOrderError",
    "simulate_step",
    "simulation_dict",
    "simulation_text",
]
