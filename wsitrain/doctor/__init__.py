"""``wsitrain doctor``: check the engine on this machine's device and write one report (see ``command``)."""

from wsitrain.doctor.command import run_doctor

__all__ = ["run_doctor"]
