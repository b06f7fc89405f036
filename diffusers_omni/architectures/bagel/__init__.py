"""BAGEL (``ByteDance-Seed/BAGEL-7B-MoT``): the ``Qwen2MoTModel`` backbone, ``BagelModel`` and ``BagelPipeline``."""

from .modeling_bagel import BagelKVCache, BagelModel, BagelMoTAttention, BagelMoTAttnProcessor, Qwen2MoTModel
from .pipeline_bagel import BagelPipeline

__all__ = ["BagelKVCache", "BagelModel", "BagelMoTAttention", "BagelMoTAttnProcessor", "BagelPipeline",
           "Qwen2MoTModel"]
