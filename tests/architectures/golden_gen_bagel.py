"""Golden tensors for BAGEL parity, made with the reference implementation (ByteDance-Seed/Bagel) on CPU.

Run (outside the diffusers-omni repository) from a clone of ByteDance-Seed/Bagel with:
* a CPU stand-in for ``flash_attn.flash_attn_varlen_func`` (per-sample softmax attention in float32, causal masks
  aligned bottom-right as flash-attn does) on PYTHONPATH;
* ``modeling/bagel/qwen2_navit.py``'s hard-coded ``torch.bfloat16`` casts (made for flash-attn) set to float32;
* ``modeling/qwen2/modeling_qwen2.py``'s rotary init computing the standard (``"default"``) inverse frequencies
  inline (Transformers 5 dropped that table entry).

    python golden_gen_bagel.py OUT.safetensors VOCAB_SIZE BOS EOS SOI EOI

Weights: every tensor of the model's state dict is ``randn(shape) * 0.2`` (``+ 1`` for norm weights) from a
generator seeded with ``zlib.crc32(name)``, so the test rebuilds identical weights from the names alone.
"""

import sys
import zlib
from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from modeling.bagel.bagel import Bagel, BagelConfig
from modeling.bagel.qwen2_navit import NaiveCache, Qwen2Config, Qwen2ForCausalLM
from modeling.bagel.siglip_navit import SiglipVisionConfig, SiglipVisionModel


def fill(model):
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            value = torch.randn(tensor.shape, generator=g) * 0.2
            if "norm" in name and name.endswith("weight"):
                value += 1.0
            tensor.copy_(value)


out, vocab, bos, eos, soi, eoi = sys.argv[1], *map(int, sys.argv[2:])
llm = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, pad_token_id=None, qk_norm=True,
                  tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer")
vit = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         image_size=56, patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
vit.rope = False
vit.num_hidden_layers -= 1
cfg = BagelConfig(visual_gen=True, visual_und=True, llm_config=llm, vit_config=vit,
                  vae_config=SimpleNamespace(downsample=2, z_channels=4), vit_max_num_patch_per_side=4,
                  connector_act="gelu_pytorch_tanh", latent_patch_size=2, max_latent_size=8)
model = Bagel(Qwen2ForCausalLM(llm), SiglipVisionModel(vit), cfg)
model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit)
fill(model)
model.eval()
model.language_model.model.enable_taylorseer = False

prompt_ids = [bos, 40, 41, 72, 5, 99, eos]
height, width = 16, 12
tokens = (height // 4) * (width // 4)
noise = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1234))
new_ids = {"bos_token_id": bos, "eos_token_id": eos, "start_of_image": soi, "end_of_image": eoi}


class Ids:  # the reference tokenizes inside prepare_prompts; hand it the ids (without BOS/EOS, which it adds)
    def encode(self, text):
        return prompt_ids[1:-1]


with torch.no_grad():
    # Understanding mode over the prompt: the final-norm hidden states and the logits.
    ids = torch.tensor(prompt_ids)
    und = model.language_model.forward_inference(
        packed_query_sequence=model.language_model.model.embed_tokens(ids), query_lens=torch.tensor([len(ids)]),
        packed_query_position_ids=torch.arange(len(ids)), packed_query_indexes=torch.arange(len(ids)),
        past_key_values=NaiveCache(2), key_values_lens=torch.tensor([0]),
        packed_key_value_indexes=torch.tensor([], dtype=torch.long), update_past_key_values=False, is_causal=True,
        mode="und").packed_query_sequence
    logits = model.language_model.lm_head(und[-1:])  # the next-token logits

    empty = {"kv_lens": [0], "ropes": [0], "past_key_values": NaiveCache(2)}
    gen_in, kv_lens, ropes = model.prepare_prompts([0], [0], ["-"], Ids(), new_ids)
    cache = model.forward_cache_update_text(NaiveCache(2), **gen_in)
    latent_in = model.prepare_vae_latent(kv_lens, ropes, [(height, width)], new_ids)
    latent_in["packed_init_noises"] = noise.clone()
    cfg_in = model.prepare_vae_latent_cfg([0], [0], [(height, width)])
    common = dict(past_key_values=cache, timestep_shift=3.0, cfg_interval=[0.4, 1.0], cfg_renorm_min=0.0,
                  cfg_text_packed_position_ids=cfg_in["cfg_packed_position_ids"],
                  cfg_text_packed_query_indexes=cfg_in["cfg_packed_query_indexes"],
                  cfg_text_key_values_lens=cfg_in["cfg_key_values_lens"],
                  cfg_text_past_key_values=empty["past_key_values"],
                  cfg_text_packed_key_value_indexes=cfg_in["cfg_packed_key_value_indexes"], cfg_img_scale=1.0)

    # The conditional velocity at t=1 (no guidance).
    step_in = {k: v for k, v in latent_in.items() if k != "packed_init_noises"}
    v_cond = model._forward_flow(x_t=noise.clone(), timestep=torch.ones(tokens), cfg_text_scale=1.0,
                                 **{k: v for k, v in step_in.items()},
                                 past_key_values=cache)
    outputs = {"prompt_ids": ids, "noise": noise, "und_hidden": und, "und_logits": logits, "v_cond_t1": v_cond}
    for renorm in ("global", "channel"):
        final = model.generate_image(**latent_in, num_timesteps=4, cfg_text_scale=4.0, cfg_renorm_type=renorm,
                                     **common)[0]
        outputs[f"latents_cfg4_{renorm}"] = final
    final = model.generate_image(**latent_in, num_timesteps=4, cfg_text_scale=1.0, **common)[0]
    outputs["latents_nocfg"] = final

    # Understanding: an image (pixels given directly, [-1, 1], 28 x 42: 2 x 3 ViT patches), then the prompt, then
    # greedy decoding from <|im_start|> (Bagel.generate_text), and the logits of the first decoding step.
    pixels = torch.rand(3, 28, 42, generator=torch.Generator().manual_seed(99)) * 2 - 1
    from copy import deepcopy
    vit_in, kv_lens, ropes = model.prepare_vit_images([0], [0], ["-"], lambda image: pixels.clone(), new_ids)
    cache = model.forward_cache_update_vit(NaiveCache(2), **vit_in)
    text_in, kv_lens, ropes = model.prepare_prompts(kv_lens, ropes, ["-"], Ids(), new_ids)
    cache = model.forward_cache_update_text(cache, **text_in)
    start = model.prepare_start_tokens(kv_lens, ropes, new_ids)
    first = model.language_model.forward_inference(
        packed_query_sequence=model.language_model.model.embed_tokens(start["packed_start_tokens"]),
        query_lens=torch.tensor([1]), packed_query_position_ids=start["packed_query_position_ids"],
        packed_query_indexes=torch.tensor([kv_lens[0]]), past_key_values=deepcopy(cache),
        key_values_lens=start["key_values_lens"], packed_key_value_indexes=start["packed_key_value_indexes"],
        update_past_key_values=True, is_causal=True, mode="und").packed_query_sequence
    # (the pixels are not stored: the test draws them with the same generator)
    outputs["image_first_logits"] = model.language_model.lm_head(first)
    outputs["image_text_ids"] = model.generate_text(past_key_values=cache, max_length=8, do_sample=False,
                                                    end_token_id=eos, **start)[:, 0]
    # Text only: the prompt, then greedy decoding.
    text_in, kv_lens, ropes = model.prepare_prompts([0], [0], ["-"], Ids(), new_ids)
    cache = model.forward_cache_update_text(NaiveCache(2), **text_in)
    start = model.prepare_start_tokens(kv_lens, ropes, new_ids)
    outputs["text_text_ids"] = model.generate_text(past_key_values=cache, max_length=8, do_sample=False,
                                                   end_token_id=eos, **start)[:, 0]

save_file({k: v.contiguous().float() if v.is_floating_point() else v.contiguous() for k, v in outputs.items()}, out)
print({k: tuple(v.shape) for k, v in outputs.items()})
