"""SoulX-Singer (Soul-AILab): zero-shot singing voice synthesis and conversion by conditional flow matching.

``SoulXSingerPipeline`` sings a score in the voice of a prompt recording; ``SoulXSingerSVCPipeline`` re-sings a
recording in that voice. Their DiT is :class:`DiffLlama` at ``cfm_decoder.model.diff_estimator``.
"""

from .modeling_diffllama import DiffLlama, DiffLlamaAttention, DiffLlamaAttnProcessor, DiffLlamaDecoderLayer
from .modeling_soulx_singer import (
    SoulXSingerCFMDecoder,
    SoulXSingerConditionEncoder,
    SoulXSingerMelSpectrogram,
    SoulXSingerVocoder,
    f0_to_coarse,
    slaney_mel_filterbank,
)
from .pipeline_soulx_singer import SoulXSingerPipeline, SoulXSingerPipelineOutput, SoulXSingerSVCPipeline
from .processing_soulx_singer import SoulXSingerScoreProcessor

__all__ = [
    "DiffLlama",
    "DiffLlamaAttention",
    "DiffLlamaAttnProcessor",
    "DiffLlamaDecoderLayer",
    "SoulXSingerCFMDecoder",
    "SoulXSingerConditionEncoder",
    "SoulXSingerMelSpectrogram",
    "SoulXSingerPipeline",
    "SoulXSingerPipelineOutput",
    "SoulXSingerSVCPipeline",
    "SoulXSingerScoreProcessor",
    "SoulXSingerVocoder",
    "f0_to_coarse",
    "slaney_mel_filterbank",
]
