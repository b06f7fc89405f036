"""Attention backends, one file per family. Import lazily through ``diffusers_omni.attention.registry``."""

from .base import AttentionBackend as AttentionBackend
from .base import AttentionCall as AttentionCall
