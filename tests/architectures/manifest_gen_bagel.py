"""How ``data/bagel_7b_mot_manifest.json`` was made (documentation; not run by the tests).

The reference implementation (ByteDance-Seed/Bagel), built on the meta device at the published BAGEL-7B-MoT config
exactly as its ``app.py`` builds it (``qk_norm``, untied embeddings, ``Qwen2MoTDecoderLayer``; SigLIP without RoPE and
one layer less than ``vit_config.json``; the patch convolution converted to a ``Linear``; ``max_latent_size`` 64,
``vit_max_num_patch_per_side`` 70, ``latent_patch_size`` 2; VAE downsampling 8, 16 latent channels). Run from a
clone of the reference with the CPU adjustments listed in ``data/README.md``:

    python manifest_gen_bagel.py OUT.json

The checkpoint's config files are not reachable from here; the numbers below are Qwen2.5-7B's (``llm_config.json``
of BAGEL-7B-MoT is Qwen2.5-7B-Instruct's) and SigLIP so400m-patch14's at 980 px (``vit_config.json``); the total,
14.6 B parameters, is the "14B total" of the model card.
"""

import json, sys, torch
from accelerate import init_empty_weights
from modeling.bagel.qwen2_navit import Qwen2ForCausalLM, Qwen2Config
from modeling.bagel.bagel import Bagel, BagelConfig
from modeling.bagel.siglip_navit import SiglipVisionConfig, SiglipVisionModel
from types import SimpleNamespace
llm = Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, pad_token_id=None, qk_norm=True, tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer")
vit = SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    num_channels=3, image_size=980, patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
vit.rope = False
vit.num_hidden_layers -= 1
vae = SimpleNamespace(downsample=8, z_channels=16)
cfg = BagelConfig(visual_gen=True, visual_und=True, llm_config=llm, vit_config=vit, vae_config=vae,
    vit_max_num_patch_per_side=70, connector_act="gelu_pytorch_tanh", latent_patch_size=2, max_latent_size=64)
with init_empty_weights():
    lm = Qwen2ForCausalLM(llm); vm = SiglipVisionModel(vit); model = Bagel(lm, vm, cfg)
    model.vit_model.vision_model.embeddings.convert_conv2d_to_linear(vit, meta=True)
sd = model.state_dict()
out = {k: list(v.shape) for k, v in sd.items()}
json.dump(out, open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(out), sum(v.numel() for v in sd.values()))
