"""Leaf helpers shared by every layer; nothing here imports the rest of the package."""
