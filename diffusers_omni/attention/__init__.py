"""Attention: registry, selector, platform routing, backends and processors."""
