"""How golden_score_processor.pt was made (documentation: the tests never import or run this file).

Run outside this repository as ``python golden_gen_score_processor.py REF OUT`` with REF a checkout of
github.com/Soul-AILab/SoulX-Singer (commit 4849326) importable as ``soulxsinger``. The reference's ``DataProcessor``
turns the first segment of its example metadata (``example/audio/zh_prompt.json``, Mandarin, and
``example/audio/en_target.json``, English, whose notes split into several phonemes) into the pipeline's tensors with
its phone set (``soulxsinger/utils/phoneme/phone_set.json``). Saved: those tensors, the two metadata entries without
their lyrics text (which the processing does not read), and the part of the phone set they use (phoneme → id).
"""

import copy
import json
import sys
import types

import torch


def main(ref, out_path):
    sys.path.insert(0, ref)
    # The processor's module imports an audio loader it uses only for waveforms, which are not processed here.
    sys.modules.setdefault("soulxsinger.utils.audio_utils", types.SimpleNamespace(load_wav=None))
    from soulxsinger.utils.data_processor import DataProcessor

    phone_set_path = f"{ref}/soulxsinger/utils/phoneme/phone_set.json"
    dp = DataProcessor(hop_size=480, sample_rate=24000, phoneset_path=phone_set_path, device="cpu")
    metas = {name: {k: v for k, v in json.load(open(f"{ref}/example/audio/{name}.json"))[0].items() if k != "text"}
             for name in ("zh_prompt", "en_target")}
    out, ids = {}, set()
    for name, meta in metas.items():
        item = dp.process(copy.deepcopy(meta), None)
        for key in ("phoneme", "note_pitch", "note_type", "mel2note"):
            out[f"{name}.{key}"] = item[key][0].to(torch.int16).clone()
        out[f"{name}.f0"] = item["f0"][0].clone()
        ids |= set(out[f"{name}.phoneme"].tolist())
    phone_set = json.load(open(phone_set_path))
    out["phone_subset"] = json.dumps({phone_set[i]: i for i in sorted(ids)})
    out["metas"] = json.dumps(metas, ensure_ascii=False)
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
