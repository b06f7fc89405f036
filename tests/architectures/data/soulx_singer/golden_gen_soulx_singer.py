"""How golden_soulx_singer.pt was made (documentation: the tests never import or run this file).

Run outside this repository, with the reference implementation (github.com/Soul-AILab/SoulX-Singer, commit 4849326)
importable as ``soulxsinger`` and Transformers 4.41.2 (the version its requirements pin; its ``DiffLlama`` subclasses
that version's ``LlamaModel``/``LlamaDecoderLayer``). The reference imports librosa (only for the mel filter bank),
torchaudio (only two helpers the vocoder never calls) and omegaconf (only a type); where they are not installed,
stand-ins provide ``librosa.filters.mel`` (Slaney filter bank, the formula of librosa's defaults) and an attribute
dict. The mel filter bank the reference used is saved in the golden file, so the comparison does not depend on it.

The SVC path of the reference (``soulxsinger/models/soulxsinger_svc.py``, published after that commit) is the same
modules (``f0_encoder``, ``cfm_decoder``, ``mel``, ``vocoder``) plus a Whisper encoder; its ``infer_segment`` glue
(coarse F0 of prompt and target, Whisper states cut/padded to the F0 frames, summed with the F0 embedding) is
spelled out below over the reference modules, with a tiny Transformers 4.41 ``WhisperEncoder``. Audio runs at
16 kHz so the reference's resampling to Whisper's rate is the identity.

Weights: every parameter and persistent buffer except the mel filter bank and the STFT windows is drawn by name
(``diffusers_omni.testing.tiny_soulx_singer.soulx_singer_weight_init``'s rule, repeated here), so the same tiny
weights are rebuilt in the test from the names alone. Random draws of the reference's sampler come from
``torch.manual_seed(SEED)``, which on CPU gives the same values as ``torch.Generator().manual_seed(SEED)``.
"""

import math
import sys
import zlib

import torch

SEED = 1234
AUDIO = dict(hop_size=320, sample_rate=16000, max_length=36000, n_fft=640, num_mels=16, win_size=640, fmin=0,
             fmax=8000, mel_var=8.14, mel_mean=-4.92)
ENCODER = dict(vocab_size=40, text_dim=16, pitch_dim=16, type_dim=16, f0_bin=361, f0_dim=16, num_layers=2)
FLOW = dict(mel_dim=16, hidden_size=32, num_layers=2, num_heads=2, cfg_drop_prob=0.2, use_embedding=False,
            cond_codebook_size=16, cond_scale_factor=1, sigma=1e-5, time_scheduler="cos")
VOCOS = dict(input_channels=16, dim=32, intermediate_dim=64, num_layers=2, n_fft=640, hop_size=320, padding="same")
COMPUTED = ("mel_basis", "hann_window", "window")


@torch.no_grad()
def init_by_name(module, seed=0):
    for name, tensor in module.state_dict().items():
        if name.rsplit(".", 1)[-1] in COMPUTED:
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        std = 1 / math.sqrt(tensor[0].numel()) if tensor.ndim >= 2 else 0.1
        tensor.copy_(values * std)
    return module.eval()


def wave(samples, freq, phase=0.0):
    t = torch.arange(samples, dtype=torch.float64) / AUDIO["sample_rate"]
    return (0.3 * torch.sin(2 * math.pi * freq * t + phase) + 0.05 * torch.sin(2 * math.pi * 3.1 * freq * t)).float()


class Cfg(dict):
    __getattr__ = dict.__getitem__


def main(out_path):
    from soulxsinger.models.modules import vocoder as vocoder_module
    from soulxsinger.models.soulxsinger import SoulXSinger

    defaults = vocoder_module._get_vocoder_default_cfg()
    defaults["model"]["vocos"] = VOCOS
    vocoder_module._get_vocoder_default_cfg = lambda: defaults

    config = Cfg(audio=Cfg(AUDIO), model=Cfg(encoder=Cfg(ENCODER), flow_matching=Cfg(FLOW)))
    model = init_by_name(SoulXSinger(config))
    hop = AUDIO["hop_size"]
    golden = {"mel_basis": model.mel.model.mel_basis.clone()}
    # The vocoder alone on 3 frames; the pipelines' goldens are the mel frames they hand the vocoder.
    vocoder_in = torch.randn(1, 16, 3, generator=torch.Generator().manual_seed(SEED))
    golden.update(vocoder_in=vocoder_in, vocoder_out=model.vocoder(vocoder_in).reshape(-1).clone())
    captured = []
    vocoder_forward = model.vocoder.forward
    model.vocoder.forward = lambda mel: captured.append(mel.transpose(1, 2).clone()) or vocoder_forward(mel)

    # 1. The estimator alone, with and without a frame mask.
    est = model.cfm_decoder.model.diff_estimator
    g = torch.Generator().manual_seed(SEED)
    x, cond, t = torch.randn(1, 18, 16, generator=g), torch.randn(1, 18, 32, generator=g), torch.tensor([0.3])
    mask = torch.ones(1, 18)
    mask[:, 15:] = 0
    golden.update(est_x=x, est_cond=cond, est_t=t, est_mask=mask, est_out=est(x, t, cond, torch.ones(1, 18)),
                  est_out_masked=est(x, t, cond, mask))

    # 2. SVS, melody and score control (the tiny inputs of diffusers_omni.testing.tiny_soulx_singer).
    prompt = dict(waveform=wave(8 * hop, 220.0)[None], phoneme=torch.tensor([[0, 5, 9, 12]]),
                  note_type=torch.tensor([[1, 2, 2, 3]]), mel2note=torch.tensor([[1, 1, 2, 2, 2, 3, 3, 0]]),
                  note_pitch=torch.tensor([[0, 57, 59, 60]]),
                  f0=torch.tensor([[0.0, 220.0, 221.5, 246.9, 247.0, 0.0, 261.6, 262.0]]))
    target = dict(phoneme=torch.tensor([[0, 7, 3, 21, 30]]), note_type=torch.tensor([[1, 2, 3, 2, 2]]),
                  mel2note=torch.tensor([[1, 1, 2, 2, 3, 3, 3, 4, 4, 0]]), note_pitch=torch.tensor([[0, 55, 57, 0, 62]]),
                  f0=torch.tensor([[196.0, 197.0, 0.0, 220.0, 233.1, 246.9, 0.0, 261.6, 293.7, 0.0]]))
    for control in ("melody", "score"):
        for shift in (0, 2):
            torch.manual_seed(SEED)
            model.infer({"prompt": dict(prompt), "target": dict(target)}, pitch_shift=shift, n_steps=3, cfg=3,
                        control=control)
            golden[f"svs_{control}_shift{shift}"] = captured.pop()  # [1, frames, num_mels]
        torch.manual_seed(SEED)
        model.infer({"prompt": dict(prompt), "target": dict(target)}, auto_shift=True, n_steps=3, cfg=3,
                    control=control)
        golden[f"svs_{control}_auto"] = captured.pop()

    # 3. SVC: the reference's infer_segment glue over the same modules (the SVC checkpoint has no note encoders).
    from transformers import WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    whisper = init_by_name(WhisperEncoder(WhisperConfig(d_model=16, encoder_layers=1, encoder_attention_heads=2,
                                                        encoder_ffn_dim=32, num_mel_bins=8,
                                                        max_source_positions=1500)))
    fe = WhisperFeatureExtractor(feature_size=8, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)

    def encode(wav):
        inputs = fe(wav.numpy(), sampling_rate=16000, return_tensors="pt", padding=False, truncation=False,
                    return_attention_mask=True)
        feats = inputs.input_features
        feats = torch.nn.functional.pad(feats, (0, 3000 - feats.shape[-1])) if feats.shape[-1] < 3000 else feats[..., :3000]
        out = whisper(feats).last_hidden_state
        valid = (inputs.attention_mask.sum(dim=1) + 1) // 2
        out = out[:, : min(int(valid.max()), out.shape[1])]
        return out

    F = torch.nn.functional
    pt_wav, gt_wav = wave(8 * hop, 220.0)[None], wave(10 * hop, 180.0, 0.5)[None]
    pt_f0, gt_f0 = prompt["f0"], target["f0"]
    for shift in (0, 2):
        pt_mel = model.mel(pt_wav)
        n = pt_mel.shape[1]
        pf0 = F.pad(pt_f0, (0, max(0, n - pt_f0.shape[1])))[:, :n]
        c_pt, c_gt = model.f0_to_coarse(pf0), model.f0_to_coarse(gt_f0, f0_shift=shift * 5)
        f_pt, f_gt = encode(pt_wav[0]), encode(gt_wav[0])
        f_pt = F.pad(f_pt, (0, 0, 0, max(0, c_pt.shape[1] - f_pt.shape[1])))[:, : c_pt.shape[1]]
        f_gt = F.pad(f_gt, (0, 0, 0, max(0, c_gt.shape[1] - f_gt.shape[1])))[:, : c_gt.shape[1]]
        features = torch.cat([f_pt, f_gt], 1) + model.f0_encoder(torch.cat([c_pt, c_gt], 1))
        torch.manual_seed(SEED)
        mel = model.cfm_decoder.reverse_diffusion(pt_mel, features[:, :n], features[:, n:], n_timesteps=3, cfg=3)
        golden[f"svc_shift{shift}"] = mel.clone()  # [1, frames, num_mels]; the vocoder is checked above

    torch.save(golden, out_path)


if __name__ == "__main__":
    with torch.no_grad():
        main(sys.argv[1])
