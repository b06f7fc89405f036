"""NextStep-1.1 (stepfun-ai): an autoregressive text-to-image model over continuous image tokens."""

from .modeling_nextstep import NextStepFlowMatchingHead, NextStepKVCache, NextStepModel
from .pipeline_nextstep import NextStep11Pipeline
from .vae import load_nextstep_vae

__all__ = ["NextStep11Pipeline", "NextStepFlowMatchingHead", "NextStepKVCache", "NextStepModel", "load_nextstep_vae"]
