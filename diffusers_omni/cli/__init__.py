"""The ``diffusers-omni`` command line: ``info``, ``explain``, ``generate``."""
