"""Leaf helpers shared by every layer (installed versions, module paths, plain-text tables, byte progress bars).

Nothing here imports the rest of the package: see docs/design/layers.md.
"""
