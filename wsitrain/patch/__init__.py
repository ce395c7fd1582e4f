"""Patch encoders applied to a grid of patches: the encoders themselves (encoders) and the trunk the engine tiles."""
