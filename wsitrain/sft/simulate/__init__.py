"""The simulated device: one training step of the real executor on fake tensors, counting live storages."""
