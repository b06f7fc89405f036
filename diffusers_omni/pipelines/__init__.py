"""Omni pipeline classes. Imported lazily: they import Diffusers' pipelines."""
