"""Planning on shapes only: the memory model, the time model, per-segment options and the search that
assembles a frozen ``Plan``. Nothing here runs a user's module.
"""
