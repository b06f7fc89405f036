"""Where the text and image encoders that Diffusers pipelines use keep their blocks (layerwise offload streams them).

Data, one row per encoder family: the class name and the dotted paths of its block lists in the order its forward
runs them (a vision tower before the language model it feeds). transformers has moved some of them between major
versions (``CLIPTextModel.text_model.encoder.layers`` became ``CLIPTextModel.encoder.layers`` in 5.x), so a row
lists every spelling and the ones that exist are used. A class with no row, or whose spellings all miss, is scanned
(``offload.discovery.scan_block_lists``). A model class can also say it itself with
``_layerwise_offload_blocks_attrs``, as DiTs do; that wins over this table.
"""

from __future__ import annotations

import torch.nn as nn

_T5 = ("encoder.block",)
_CLIP_TEXT = ("text_model.encoder.layers", "encoder.layers")
_CLIP_VISION = ("vision_model.encoder.layers", "encoder.layers")
_DECODER = ("layers",)
_CAUSAL_LM = ("model.layers",)

ENCODER_BLOCKS: dict[str, tuple[str, ...]] = {
    # T5 family (FLUX.1, SD3, Chroma, Wan's UMT5, LTX-Video, CogVideoX)
    "T5EncoderModel": _T5,
    "UMT5EncoderModel": _T5,
    "MT5EncoderModel": _T5,
    # CLIP (FLUX.1, SD3, SDXL, Wan 2.1 I2V's image encoder)
    "CLIPTextModel": _CLIP_TEXT,
    "CLIPTextModelWithProjection": _CLIP_TEXT,
    "CLIPVisionModel": _CLIP_VISION,
    "CLIPVisionModelWithProjection": _CLIP_VISION,
    "SiglipVisionModel": _CLIP_VISION,
    "SiglipTextModel": _CLIP_TEXT,
    # Decoder-only language models used as text encoders (bare models and causal-LM wrappers)
    "Qwen2Model": _DECODER,
    "Qwen3Model": _DECODER,
    "LlamaModel": _DECODER,
    "MistralModel": _DECODER,
    "GemmaModel": _DECODER,
    "Gemma2Model": _DECODER,
    "Qwen2ForCausalLM": _CAUSAL_LM,
    "Qwen3ForCausalLM": _CAUSAL_LM,
    "LlamaForCausalLM": _CAUSAL_LM,
    "MistralForCausalLM": _CAUSAL_LM,
    "Gemma2ForCausalLM": _CAUSAL_LM,
    # Vision-language models (Qwen-Image, FLUX.2, LTX-2, HunyuanVideo): vision tower first, then the language model
    "Qwen2_5_VLForConditionalGeneration": ("model.visual.blocks", "visual.blocks", "model.language_model.layers",
                                           "model.layers"),
    "Qwen2_5_VLModel": ("visual.blocks", "language_model.layers"),
    "Qwen2_5_VLTextModel": _DECODER,  # HunyuanVideo-1.5
    "Qwen2VLTextModel": _DECODER,
    "Qwen3VLForConditionalGeneration": ("model.visual.blocks", "model.language_model.layers"),
    "Mistral3ForConditionalGeneration": ("model.vision_tower.transformer.layers", "vision_tower.transformer.layers",
                                         "model.language_model.layers", "language_model.model.layers"),
    "Gemma3ForConditionalGeneration": ("model.vision_tower.vision_model.encoder.layers",
                                       "vision_tower.vision_model.encoder.layers", "model.language_model.layers",
                                       "language_model.model.layers"),
    "LlavaForConditionalGeneration": ("model.vision_tower.vision_model.encoder.layers",
                                      "model.language_model.layers"),
}


def _exists(module: nn.Module, path: str) -> bool:
    current: object = module
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return False
    return isinstance(current, nn.Module)


def encoder_blocks_attrs(module: nn.Module) -> tuple[tuple[str, ...], str]:
    """The block-list paths of encoder ``module`` that exist on it, and where they came from: ``"model"`` (its own
    ``_layerwise_offload_blocks_attrs``), ``"declared"`` (``ENCODER_BLOCKS``) or ``""`` (nothing known: scan)."""
    own = getattr(module, "_layerwise_offload_blocks_attrs", None)
    if own:
        return tuple(own), "model"
    for klass in type(module).__mro__:
        paths = ENCODER_BLOCKS.get(klass.__name__)
        if paths:
            found = tuple(path for path in paths if _exists(module, path))
            if found:
                return found, "declared"
    return (), ""
