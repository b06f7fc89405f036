"""Documentation only (not collected, not imported by the tests): how nextstep_golden.safetensors and
nextstep_manifest.json were made. Run outside the repository with VLLM_OMNI_SRC pointing at the unpacked
vllm-omni 0.30.0 wheel (`pip download --no-deps vllm-omni==0.30.0`, unzip) and einops importable:

    python golden_gen_nextstep.py golden OUT.safetensors
    python golden_gen_nextstep.py manifest OUT.json

vLLM itself is not needed: its tensor-parallel linears are replaced below by single-device stand-ins (fused
q/k/v and gate/up weights, loaded through the reference load_weights from our checkpoint-named tensors).
"""
import sys, types, os
import torch, torch.nn as nn
SRC = os.environ["VLLM_OMNI_SRC"]

def mod(name, **attrs):
    m = types.ModuleType(name); m.__dict__.update(attrs); sys.modules[name] = m; return m

def _loader(param, w, shard_id=None):
    param.data.copy_(w)

class _Lin(nn.Module):
    def __init__(self, i, o, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(o, i)); self.weight.weight_loader = self._load
        self.bias = nn.Parameter(torch.empty(o)) if bias else None
        if bias: self.bias.weight_loader = self._load
        self.offsets = {}
    def _load(self, param, w, shard_id=None):
        if shard_id is None: param.data.copy_(w); return
        start, size = self.offsets[shard_id]; param.data[start:start+size].copy_(w)
    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias), None

class QKVParallelLinear(_Lin):
    def __init__(self, hidden_size, head_size, total_num_heads, total_num_kv_heads, bias=False, **kw):
        q, kv = total_num_heads*head_size, total_num_kv_heads*head_size
        super().__init__(hidden_size, q+2*kv, bias)
        self.num_heads, self.num_kv_heads = total_num_heads, total_num_kv_heads
        self.offsets = {"q": (0, q), "k": (q, kv), "v": (q+kv, kv)}
class MergedColumnParallelLinear(_Lin):
    def __init__(self, input_size, output_sizes, bias=False, **kw):
        super().__init__(input_size, sum(output_sizes), bias)
        self.offsets = {0: (0, output_sizes[0]), 1: (output_sizes[0], output_sizes[1])}
class RowParallelLinear(_Lin):
    def __init__(self, input_size, output_size, bias=False, **kw):
        super().__init__(input_size, output_size, bias)

def install():
    import transformers, transformers.cache_utils, diffusers, diffusers.image_processor  # noqa: before the stub
    import transformers.modeling_attn_mask_utils, transformers.modeling_outputs, transformers.models.llama.configuration_llama
    tv = mod("torchvision"); tv.__path__ = []
    mod("torchvision.transforms", Compose=lambda *a, **k: None, ToTensor=lambda *a, **k: None, Normalize=lambda *a, **k: None)
    mod("vllm"); mod("vllm.model_executor"); mod("vllm.model_executor.layers")
    mod("vllm.model_executor.layers.linear", QKVParallelLinear=QKVParallelLinear,
        MergedColumnParallelLinear=MergedColumnParallelLinear, RowParallelLinear=RowParallelLinear)
    mod("vllm.model_executor.model_loader"); mod("vllm.model_executor.model_loader.weight_utils", default_weight_loader=_loader)
    import logging
    mod("vllm.logger", init_logger=logging.getLogger)
    mod("vllm.model_executor.models"); mod("vllm.model_executor.models.utils", AutoWeightsLoader=object)
    # vllm_omni packages without running their __init__
    for name, path in [("vllm_omni", "vllm_omni"), ("vllm_omni.diffusion", "vllm_omni/diffusion"),
                       ("vllm_omni.diffusion.models", "vllm_omni/diffusion/models"),
                       ("vllm_omni.diffusion.models.nextstep_1_1", "vllm_omni/diffusion/models/nextstep_1_1"),
                       ("vllm_omni.model_executor", "vllm_omni/model_executor"),
                       ("vllm_omni.model_executor.layers", "vllm_omni/model_executor/layers")]:
        m = mod(name); m.__path__ = [os.path.join(SRC, path)]
    class _Out:
        def __init__(self, **kw): self.__dict__.update(kw)
    mod("vllm_omni.diffusion.data", DiffusionOutput=_Out, OmniDiffusionConfig=object)
    mod("vllm_omni.diffusion.distributed"); mod("vllm_omni.diffusion.distributed.parallel_state",
        get_cfg_group=lambda: None, get_classifier_free_guidance_rank=lambda: 0,
        get_classifier_free_guidance_world_size=lambda: 1)
    mod("vllm_omni.diffusion.distributed.utils", get_local_device=lambda: torch.device("cpu"))
    mod("vllm_omni.diffusion.model_loader"); mod("vllm_omni.diffusion.model_loader.diffusers_loader", DiffusersPipelineLoader=object)
    mod("vllm_omni.diffusion.models.interface", SupportsComponentDiscovery=type("S", (), {}))
    mod("vllm_omni.diffusion.profiler"); mod("vllm_omni.diffusion.profiler.diffusion_pipeline_profiler",
        DiffusionPipelineProfilerMixin=type("P", (), {}))
    mod("vllm_omni.diffusion.worker"); mod("vllm_omni.diffusion.worker.request_batch", DiffusionRequestBatch=object)
    mod("vllm_omni.model_executor.model_loader"); mod("vllm_omni.model_executor.model_loader.weight_utils",
        download_weights_from_hf_specific=None)

def shim_cache():
    # vllm-omni 0.30.0 targets a transformers whose StaticCache has get_max_cache_shape; 5.x calls it get_max_length.
    from transformers.cache_utils import StaticCache
    if not hasattr(StaticCache, "get_max_cache_shape"):
        StaticCache.get_max_cache_shape = lambda self: self.get_max_length()


# ---- golden ----
def golden(path):
    from vllm_omni.diffusion.models.nextstep_1_1.modeling_nextstep import NextStepConfig, NextStepModel as RefModel
    from vllm_omni.diffusion.models.nextstep_1_1.modeling_flux_vae import AutoencoderKL as RefAE, AutoEncoderParams
    from vllm_omni.diffusion.models.nextstep_1_1 import pipeline_nextstep_1_1 as refpipe
    from transformers.cache_utils import StaticCache
    from diffusers.image_processor import VaeImageProcessor
    from diffusers_omni.testing.tiny_nextstep import tiny_nextstep_pipeline, TINY_NEXTSTEP_VAE
    from diffusers_omni.architectures.nextstep.vae import nextstep_vae_state_dict

    ours = tiny_nextstep_pipeline(0)
    mc = ours.model.config
    cfg = NextStepConfig(vocab_size=mc.vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_hidden_layers, num_attention_heads=mc.num_attention_heads,
        num_key_value_heads=mc.num_key_value_heads, head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta, attention_bias=True, o_attention_bias=False, mlp_bias=False,
        latent_channels=16, latent_patch_size=2, fm_head_dim=mc.fm_head_dim, fm_head_layers=mc.fm_head_layers,
        boi=mc.boi, eoi=mc.eoi, image_placeholder_id=mc.image_placeholder_id, max_position_embeddings=512)
    cfg._attn_implementation = "sdpa"
    ref = RefModel(cfg).eval()
    loaded = ref.load_weights(list(ours.model.state_dict().items()))
    missing = set(dict(ref.named_parameters())) - loaded
    assert not missing, missing
    ae = RefAE(AutoEncoderParams(**TINY_NEXTSTEP_VAE)).eval()
    r = ae.load_state_dict(nextstep_vae_state_dict(ours.vae), strict=True)

    out = {}
    with torch.no_grad():
        # 1. backbone: left-padded prefill of 6 tokens, then two single-token steps (static cache, as the reference pipeline).
        g = torch.Generator().manual_seed(1)
        embeds = torch.randn(2, 8, mc.hidden_size, generator=g)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
        cache = StaticCache(config=cfg, max_cache_len=8)
        h1 = ref.forward_model(inputs_embeds=embeds[:, :6], attention_mask=mask[:, :6], past_key_values=cache, use_cache=True)
        h2 = ref.forward_model(inputs_embeds=embeds[:, 6:7], attention_mask=mask[:, :7], past_key_values=h1.past_key_values, use_cache=True)
        h3 = ref.forward_model(inputs_embeds=embeds[:, 7:8], attention_mask=mask[:, :8], past_key_values=h2.past_key_values, use_cache=True)
        out["backbone.embeds"] = embeds; out["backbone.mask"] = mask
        out["backbone.prefill"] = h1.last_hidden_state; out["backbone.step1"] = h2.last_hidden_state
        out["backbone.step2"] = h3.last_hidden_state
        # 2. flow-matching head with guidance 3 (cond rows then uncond rows), 4 steps, shift 2.
        cond = torch.randn(4, mc.hidden_size, generator=g)
        torch.manual_seed(7)
        out["head.cond"] = cond
        out["head.sample"] = ref.image_head.sample(c=cond, cfg=3.0, cfg_img=1.0, cfg_mult=2, timesteps_shift=2.0, num_sampling_steps=4)
        # 3. VAE decode
        z = torch.randn(1, 16, 8, 8, generator=g)
        out["vae.latents"] = z; out["vae.decoded"] = ae.decode(z).sample
        # 4. the whole text-to-image job through the reference pipeline's forward.
        P = refpipe.NextStep11Pipeline
        p = P.__new__(P); torch.nn.Module.__init__(p)
        tok = ours.tokenizer; tok.padding_side = "left"
        p.tokenizer = tok; p.model = ref; p.config = cfg; p.vae = ae
        p.down_factor = 2 ** (len(ae.config.block_out_channels) - 1) * 2
        p.shift_factor = ae.config.shift_factor; p.scaling_factor = ae.config.scaling_factor
        p.boi, p.eoi, p.image_placeholder_id = cfg.boi, cfg.eoi, cfg.image_placeholder_id
        p._NextStep11Pipeline__device = torch.device("cpu"); p._NextStep11Pipeline__dtype = torch.float32
        for case, kw in {"cfg": dict(guidance_scale=3.0, negative_prompt="blurry", use_norm=True, timesteps_shift=1.0, cfg_schedule="constant"),
                         "linear": dict(guidance_scale=4.0, negative_prompt=None, use_norm=False, timesteps_shift=2.0, cfg_schedule="linear"),
                         "nocfg": dict(guidance_scale=1.0, negative_prompt=None, use_norm=True, timesteps_shift=1.0, cfg_schedule="constant")}.items():
            sp = types.SimpleNamespace(height=16, width=16, num_inference_steps=2, guidance_scale_provided=True,
                guidance_scale=kw["guidance_scale"], num_outputs_per_prompt=1, seed=0, guidance_scale_2=None,
                extra_args={"timesteps_shift": kw["timesteps_shift"], "use_norm": kw["use_norm"], "cfg_schedule": kw["cfg_schedule"],
                            "positive_prompt": "best quality."})
            req = types.SimpleNamespace(prompts=[{"prompt": "a red cat", "negative_prompt": kw["negative_prompt"]}], sampling_params=sp)
            raw = p.forward(req).output
            out[f"pipeline.{case}"] = VaeImageProcessor(vae_scale_factor=2).postprocess(raw, output_type="pt")
    # 5. the generation position table (use_gen_pos_embed, an 8 x 8 grid): same run as "cfg".
    posed = tiny_nextstep_pipeline(0, use_gen_pos_embed=True)
    cfg.use_gen_pos_embed = True; cfg.base_image_grid_size = 8
    ref2 = RefModel(cfg).eval()
    ref2.load_weights(list(posed.model.state_dict().items()))
    p.model = ref2
    with torch.no_grad():
        sp = types.SimpleNamespace(height=16, width=16, num_inference_steps=2, guidance_scale_provided=True,
            guidance_scale=3.0, num_outputs_per_prompt=1, seed=0, guidance_scale_2=None,
            extra_args={"timesteps_shift": 1.0, "use_norm": True, "cfg_schedule": "constant", "positive_prompt": "best quality."})
        req = types.SimpleNamespace(prompts=[{"prompt": "a red cat", "negative_prompt": "blurry"}], sampling_params=sp)
        raw = p.forward(req).output
        out["pipeline.gen_pos_embed"] = VaeImageProcessor(vae_scale_factor=2).postprocess(raw, output_type="pt")
    from safetensors.torch import save_file
    save_file({k: v.contiguous().float() if v.is_floating_point() else v.contiguous() for k, v in out.items()},
              path)
    print({k: tuple(v.shape) for k, v in out.items()})

# ---- manifest ----
def manifest(path):
    published = {  # stepfun-ai/NextStep-1.1 config.json (fields read by the reference), see the notes
        "model_type": "nextstep", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "attention_bias": True,
        "o_attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
        "boi": 151667, "eoi": 151668, "image_placeholder_id": 151669, "pad_token_id_added": 151665,
        "base_image_grid_size": 64, "bos_token_id": 151643, "eos_token_id": 151643, "vocab_size": 152064,
    }
    cfg = NextStepConfig(**published)
    with torch.device("meta"):
        ref = RefModel(cfg)
    H, D, KV = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    params = {}
    for name, p in ref.named_parameters():
        shape = list(p.shape)
        if ".qkv_proj." in name:
            for part, rows in (("q_proj", H * D), ("k_proj", KV * D), ("v_proj", KV * D)):
                params[name.replace("qkv_proj", part)] = [rows] + shape[1:]
        elif ".gate_up_proj." in name:
            for part in ("gate_proj", "up_proj"):
                params[name.replace("gate_up_proj", part)] = [shape[0] // 2] + shape[1:]
        else:
            params[name] = shape
    buffers = {n: list(b.shape) for n, b in ref.named_buffers()}
    print("buffers (not in the manifest):", buffers)
    manifest = {
        "checkpoint": "stepfun-ai/NextStep-1.1",
        "how": ("vllm-omni 0.30.0 NextStepModel (vllm_omni/diffusion/models/nextstep_1_1/modeling_nextstep.py) built on "
                "the meta device at `config`, with vLLM's tensor-parallel linears replaced by single-device stand-ins; "
                "its fused parameters expanded to the checkpoint names its load_weights maps from (qkv_proj <- q_proj, "
                "k_proj, v_proj; gate_up_proj <- gate_proj, up_proj). Keys are the checkpoint's, unprefixed."),
        "config_sources": {
            "from the published config.json": ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias", "o_attention_bias",
                "mlp_bias", "rms_norm_eps", "max_position_embeddings", "boi", "eoi", "image_placeholder_id",
                "pad_token_id_added", "base_image_grid_size", "bos_token_id", "eos_token_id"],
            "vocab_size": ("152064: not read from the published config.json (its tail was not reachable from here); "
                           "the vocabulary of the Qwen2.5-14B base, which holds the config's special ids 151643-151669"),
            "latent_channels, latent_patch_size, fm_head_dim, fm_head_layers": (
                "reference NextStepConfig defaults 16, 2, 1536, 12; the published config names the same values "
                "num_channels=16, patch_size=2, genloss_width=1536, genloss_depth=12, which the reference ignores"),
        },
        "config": published,
        "parameters": params,
    }
    json.dump(manifest, open(path, "w"), indent=1)
    print(len(params), sum(torch.Size(s).numel() for s in params.values()) / 1e9, "B params")

if __name__ == "__main__":
    install(); shim_cache()
    {"golden": golden, "manifest": manifest}[sys.argv[1]](sys.argv[2])
