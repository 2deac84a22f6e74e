"""Write the shipped profiles and coefficients of the catalogue's derived architectures.

For every catalogue model without hand-written formulas (``ModelSpec.family == "derived"``), this
writes its profile (``spec/profiles/<fingerprint>.json``: its tensors as transformers builds them)
and its derived coefficients (``spec/coefficients/<key>.json``) for the default setup in each of
``PRECISIONS``, with and without full recompute (no KV cache) and, for a model with a sliding window, both sides of it, so that ``estimate`` on
the catalogue needs neither torch nor a derivation; each at batch >= 2 and, for a decoder or image
model, its micro-batch-1 set (``estimate.derived.batch1``); a vision-language model's setups are
``_ship_vlm``'s. Run after changing the catalogue, transformers,
or the derivation (``make ship-derived``); ``tests/test_derived.py`` checks the shipped files are
current. ``python tools/ship_derived.py NAME ...`` writes only the named models' files;
``--batch1-only`` only their micro-batch-1 sets.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
PRECISIONS = ("bf16-amp", "bf16", "fp32")


def main() -> None:
    warnings.filterwarnings("ignore")
    from trainmem.estimate import derived
    from trainmem.spec import catalogue_names, load_config
    from trainmem.spec.config import resolve_model
    from trainmem.spec.profile import build_profile, fingerprint
    from trainmem.spec.resolve import resolve
    from trainmem.spec.tasks import TASK_KEY
    from trainmem.trace.derive import derive_coefficients
    spec_dir = os.path.join(ROOT, "src", "trainmem", "spec")
    written = 0
    args = [a for a in sys.argv[1:] if a != "--batch1-only"]
    only1 = len(args) < len(sys.argv) - 1
    for name in args or catalogue_names():  # names given: only those (a new catalogue entry)
        m = resolve_model(name)
        if m.family != "derived" or (only1 and (m.is_encoder_decoder or m.is_vlm)):  # (an encoder-decoder has no batch-1 set)
            continue
        # the resolved config: a catalogue entry's task marked (``spec.tasks.TASK_KEY``)
        cfg = {k: v for k, v in m.config.items() if not k.startswith("_") or k == TASK_KEY}
        prof = build_profile(cfg)
        _write(os.path.join(spec_dir, "profiles", f"{fingerprint(m.config)}.json"), prof.to_json())
        if m.is_vlm:  # a vision-language model: its own default setups (``_ship_vlm``)
            written += _ship_vlm(name, m, spec_dir)
            print(f"{name}: profile and its coefficient sets ({written} so far)", flush=True)
            continue
        window = derived.sliding_window(m)
        seqs = [2048] if not window or window >= m.max_positions else [max(128, window // 2), 2 * window]
        for precision, recompute in [(p, r) for p in PRECISIONS for r in ("none", "full")]:
            for seq in seqs:
                # an image model's sequence is its default image size's patches, a speech seq2seq model's its
                # encoder's fixed positions (--seq-len is refused for both)
                size = {} if m.is_image or m.is_speech_seq2seq else {"seq_len": min(seq, m.max_positions)}
                t = resolve(name, precision=precision, recompute=recompute, **size).training
                # the batch >= 2 set, then the micro-batch-1 set (an encoder-decoder has one set)
                for b in ((1,) if only1 else (2, 1)) if derived.batch1(m, replace(t, batch_size=1)) else (2,):
                    tb = replace(t, batch_size=b)
                    doc = derive_coefficients(m, derived._canonical(tb, m), derived.regime(m, tb),
                                              derived.batch1(m, tb))
                    doc["version"] = derived.COEF_VERSION
                    _write(os.path.join(spec_dir, "coefficients", f"{derived.key(m, tb)}.json"), doc)
                    written += 1
        print(f"{name}: profile and its coefficient sets ({written} so far)", flush=True)
    print(f"{written} coefficient sets written")


#: a vision-language model's shipped setups: one image per sample (its coefficients' vision side is per image,
#: any --images reads them), Qwen2-VL's images at 448 px (its size is a part of the key: others derive), the
#: precisions of ``VLM_PRECISIONS``, the tower trained or frozen, without recompute, both sides of a sliding
#: window, batch >= 2 and 1 (a VLM's derivation traces its whole vision tower: the rest derive on demand)
VLM_PRECISIONS = ("bf16-amp", "bf16")
VLM_IMAGE_SIZE = {"qwen2_vl": 448, "qwen2_5_vl": 448}


def _ship_vlm(name: str, m, spec_dir: str) -> int:
    from trainmem.estimate import derived
    from trainmem.spec.resolve import resolve
    from trainmem.trace.derive import derive_coefficients
    window = derived.sliding_window(m)
    seqs = [2048] if not window or window >= m.max_positions else [max(512, window // 2), 2 * window]
    size = {"image_size": VLM_IMAGE_SIZE[m.model_type]} if m.model_type in VLM_IMAGE_SIZE else {}
    written = 0
    for precision, frozen, seq in [(p, f, q) for p in VLM_PRECISIONS for f in (False, True) for q in seqs]:
        t = resolve(name, precision=precision, freeze_vision_tower=frozen, seq_len=seq, **size).training
        for b in (2, 1):
            tb = replace(t, batch_size=b)
            doc = derive_coefficients(m, derived._canonical(tb, m), derived.regime(m, tb), derived.batch1(m, tb))
            doc["version"] = derived.COEF_VERSION
            _write(os.path.join(spec_dir, "coefficients", f"{derived.key(m, tb)}.json"), doc)
            written += 1
    return written


def _write(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, sort_keys=True, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
