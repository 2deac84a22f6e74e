"""Every causal-LM architecture transformers ships: does estimate/trace run, refuse in one line, or break?

    nice -n 10 .venv/bin/python benchmarks/bench_architectures.py [--types a,b,...] [--slice I/N]
        [--json docs/architectures_sweep.json] [--markdown FILE] [--timeout 90] [--lora]

For each ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny config is built
with ``AutoConfig.for_model`` (``tiny_config``: hidden 64, 2 layers, 4 heads, vocab 1024; every other
integer field that names a size is shrunk; per-type fields in ``OVERRIDES``, ``FINAL`` and ``TEXT`` where the
shrinking breaks a config or transformers' default does not build; ``architectures`` names the type's causal-LM
class), then
``trainmem.estimate`` and ``trainmem.trace`` run on it through the Python API (batch 2, sequence 128,
bf16-amp; with ``--lora`` also LoRA r8) and the type is classified:

- OK: both ran (estimate vs trace of the peak allocated and the peak reserved, in %);
- REFUSED: a TrainmemError (its one line is recorded);
- CRASH: any other exception (its type, message and last frame);
- TIMEOUT: the type took longer than ``--timeout`` seconds;
- NO-CONFIG: transformers rejects the sweep's own tiny config (no verdict on trainmem).

The types run one after the other in one worker process (torch and transformers are imported once);
a worker that times out is killed and a new one takes the next type. Results are merged into the
JSON file by type, so slices can be run separately (``--slice 1/4`` ... ``4/4``).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = dict(batch_size=2, seq_len=128, precision="bf16-amp")

#: the tiny dimensions every config gets where it has the field (names as transformers' configs spell them)
TINY = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "n_embed": 64, "dim": 64, "embed_dim": 64,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "decoder_layers": 2,
    "encoder_layers": 2, "num_decoder_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 4, "n_kv_heads": 4, "num_kv_heads": 4, "multi_query_group_num": 4,
    "rotary_dim": 8, "linear_num_heads": 4, "mamba_n_heads": 8, "mamba_d_head": 16,
    "vocab_size": 1024,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "ffn_hidden_size": 128, "d_ff": 128, "ffn_size": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "n_shared_experts": 1,
    "max_position_embeddings": 512, "n_positions": 512, "n_ctx": 512, "max_seq_len": 512,
}
#: integer fields a size-looking name must not shrink (ids, counts of things that are not sizes, positions)
KEEP = ("token_id", "position", "n_positions", "n_ctx", "max_seq", "seq_len", "window", "chunk", "period",
        "theta", "base", "interval", "freq", "every", "step", "seed", "bucket")
SIZE_WORDS = ("size", "dim", "hidden", "inner", "ffn", "rank", "channels", "width")

#: per-type fields the generic shrinking cannot guess (each a config field whose default breaks a tiny model)
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},  # default None: no attention layer at all
    # default every layer Mamba-2: its cache has no attention layer, whose length the model asks for
    # (transformers 5.24 ``GraniteMoeHybridModel.forward`` ``cache.get_seq_length()``: ValueError)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "mamba2": {"head_dim": 32, "n_groups": 1},  # num_heads x head_dim = expand x hidden
    "hunyuan_v1_dense": {"head_dim": 16}, "hunyuan_v1_moe": {"head_dim": 16},  # default None breaks the build
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},  # defaults None
    # FalconH1Config's default mamba_d_ssm 1024 is no size-named field: it must equal mamba_n_heads x mamba_d_head
    # (8 x 16; transformers 5.24 ``models/falcon_h1/configuration_falcon_h1.py`` ``validate_architecture`` L122-130)
    "falcon_h1": {"mamba_d_ssm": 128},
    # ZayaConfig accepts one expert per token only (``models/zaya/configuration_zaya.py`` L123-124)
    "zaya": {"num_experts_per_tok": 1},
}
#: per-type fields set last, after the shrinking (which would undo them): the fields the real hub configs give and
#: transformers 5.24's defaults lack (spec.profile._TRANSFORMERS_BUGS), and sizes that must add up
FINAL: dict[str, dict] = {
    "ministral": {"head_dim": 16},  # Ministral-8B's config.json: head_dim 128
    "lfm2_moe": {"num_hidden_layers": 4, "num_dense_layers": 1,  # LFM2-8B-A1B's config.json: conv and attention
                 "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "dbrx": {"attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 500000}},  # DBRX's config.json
    # block_types (recurrent, recurrent, attention) repeat: 2 layers have no attention layer, whose cache length
    # the model asks for (transformers 5.24 ``RecurrentGemmaModel.forward`` ``cache.get_seq_length()``: ValueError)
    "recurrent_gemma": {"num_hidden_layers": 3},
    # Zamba2Config.__post_init__ derives these from the hidden size (transformers 5.24
    # ``models/zamba2/configuration_zamba2.py`` L113-115); the default config's dict carries them for hidden 2560
    "zamba2": {"attention_hidden_size": 128, "attention_head_dim": 32, "mamba_headdim": 16},
    # xLSTMConfig rounds qk_dim up to a multiple of 64 for its cache (``configuration_xlstm.py`` L161-176) and the
    # layer does not (``modeling_xlstm.py`` L1043): hidden 64 x qk_dim_factor 0.5 = 32 breaks transformers' own step
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    "marian": {"decoder_vocab_size": 1024},  # its pad id is vocab_size - 1: the decoder's vocabulary is as wide
    "mimo_v2_flash": {"num_key_value_heads": 1},  # sliding layers double the KV heads: 2 x 4 > 4 query heads
    # LongCat-Flash's query/key head is qk_nope_head_dim + qk_rope_head_dim (shrunk alone it no longer adds up)
    "longcat_flash": {"qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "qk_head_dim": 48, "head_dim": 16,
                      "v_head_dim": 32, "q_lora_rank": 48, "kv_lora_rank": 32, "zero_expert_num": 2},
    # Gemma 3n: a per-layer intermediate size and sparsity, and 10 of 20 layers sharing KV (the default 15 of 35)
    "gemma3n_text": {"num_hidden_layers": 20, "intermediate_size": 128, "num_kv_shared_layers": 10,
                     "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 4,
                     "activation_sparsity_pattern": [0.95] * 10 + [0.0] * 10},
    # ZambaModel ties the shared attention block of every hybrid layer to the first one's; with one hybrid layer the
    # tie has no target and the build fails (transformers 5.24 ``models/zamba/modeling_zamba.py`` L854-862, the
    # check in ``modeling_utils.py`` ``get_expanded_tied_weights_keys``): Zyphra/Zamba-7B-v1 has 13 of 76; two here
    # (and, as for zamba2, the widths ZambaConfig.__post_init__ derives from the hidden size, configuration_zamba.py
    # L98-99: the shared block reads the hidden state concatenated with the embeddings, 2 x 64)
    "zamba": {"num_hidden_layers": 5, "attention_hidden_size": 128, "attention_head_dim": 32,
              "layers_block_type": ["linear_attention", "linear_attention", "hybrid", "linear_attention", "hybrid"]},
    # ReformerModelWithLMHead asserts ``is_decoder`` (``models/reformer/modeling_reformer.py`` L2153), as
    # google/reformer-crime-and-punishment's config.json sets it; training needs the axial position shape to multiply
    # to the sequence (L233-239: 8 x 16 = 128) and its embedding widths to add up to the hidden size (L207-211)
    "reformer": {"is_decoder": True, "axial_pos_shape": [8, 16], "axial_pos_embds_dim": [16, 48]},
    # CohereCompassTextConfig's default ``rope_parameters`` is {} and its rotary embedding reads one entry per layer
    # type (``models/cohere_compass/modeling_cohere_compass.py`` L79-80): CohereLabs/North-Micro-Vision-Instruct's
    # config gives them; M-RoPE sections of a 16-wide head (8 frequencies)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}}},
}
#: the QSA indexer every Qwen4-Exp attention layer builds (transformers 5.24 ``models/qwen4_exp/modeling_qwen4_exp.py``
#: L857, L697-699: ``indexer_budget // indexer_compress_ratio``), whose fields default to None; the values obey
#: ``Qwen4ExpTextConfig.validate_architecture`` (one key head, budget a multiple of the ratio, index head >= rotary)
_QSA = {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 32,
        "indexer_compress_ratio": 4}
FINAL["qwen4_exp_text"] = _QSA
#: per-type fields of the text config of a composite config (``text_config``), set before building it and last
TEXT: dict[str, dict] = {
    "qwen4_exp": _QSA,
    # Gemma4AssistantConfig validates its text config as a drafter's: no per-layer inputs, no MoE block, no double-wide
    # MLP, every layer reading shared keys and values (``models/gemma4_assistant/configuration_gemma4_assistant.py``
    # L80-98); the default Gemma4TextConfig it builds has per-layer inputs of 256 and fails it
    "gemma4_assistant": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
                         "use_double_wide_mlp": False, "num_hidden_layers": 2, "num_kv_shared_layers": 2,
                         "layer_types": ["sliding_attention", "full_attention"]},
}


def _shrink(d: dict, depth: int = 0) -> dict:
    """``d`` (a config's dict) with TINY's fields set and every other integer size field above 128
    cut to 64; nested configs (``text_config`` ...) the same way."""
    out = dict(d)
    for k, v in d.items():
        if isinstance(v, dict) and depth < 2 and ("model_type" in v or k.endswith("_config")):
            out[k] = _shrink(v, depth + 1)
        elif k in TINY and (v is None or (isinstance(v, int) and not isinstance(v, bool))):
            out[k] = TINY[k]
        elif isinstance(v, bool) or not isinstance(v, int):
            continue
        elif v > 128 and any(w in k for w in SIZE_WORDS) and not any(w in k for w in KEEP):
            out[k] = 64
    heads, hidden = d.get("num_attention_heads"), d.get("hidden_size")
    if isinstance(d.get("head_dim"), int) and isinstance(heads, int) and d["head_dim"] * heads == hidden:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]  # a head_dim tied to the hidden size
    n = _layers_with_every_type(d)
    if n:
        for k in ("num_hidden_layers", "n_layer", "num_layers"):
            if k in out:
                out[k] = n
        for k in ("layer_types", "mlp_layer_types", "block_types", "layers_block_type"):
            if isinstance(out.get(k), list) and len(out[k]) > n:
                out[k] = out[k][:n]
    vocab = out.get("vocab_size")
    for k, v in list(out.items()):  # token ids inside the vocabulary
        if k.endswith("token_id") and isinstance(v, int) and isinstance(vocab, int) and v >= vocab:
            out[k] = vocab - 1
    return out


def _layers_with_every_type(d: dict) -> int | None:
    """The fewest leading layers (at least 2) whose ``layer_types`` (and ``mlp_layer_types``) contain
    every type the full list has; None without such a list."""
    lists = [d[k] for k in ("layer_types", "mlp_layer_types", "layers_block_type")
             if isinstance(d.get(k), list) and d[k]]
    if not lists:
        return None
    n = 2
    while n < max(map(len, lists)) and any(set(x[:n]) != set(x) for x in lists):
        n += 1
    return n


def tiny_config(model_type: str) -> dict:
    """A tiny config dict of ``model_type`` for its causal-LM class (``architectures``)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    try:
        base = AutoConfig.for_model(model_type).to_dict()
    except Exception:  # a default transformers rejects (Gemma 4's assistant's text config): with its TEXT fields
        if model_type not in TEXT:
            raise
        base = AutoConfig.for_model(model_type, text_config=TEXT[model_type]).to_dict()
    small = {k: v for k, v in _shrink(base).items() if k in TINY or base.get(k) != _shrink(base).get(k)}
    small.update(OVERRIDES.get(model_type, {}))
    if model_type in TEXT:
        small["text_config"] = dict(small.get("text_config") or base["text_config"], **TEXT[model_type])
    try:
        cfg = _shrink(AutoConfig.for_model(model_type, **small).to_dict()) | OVERRIDES.get(model_type, {})
        AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception:  # per-layer fields tied to the layer count: keep the default layers
        layers = {k for k in small if "layers" in k or k in ("n_layer", "num_layers")}
        keep = {k: v for k, v in small.items() if k not in layers and not isinstance(v, (list, dict))}
        cfg = AutoConfig.for_model(model_type, **keep).to_dict()
    cfg.update(FINAL.get(model_type, {}))
    if model_type in TEXT:
        cfg["text_config"] = dict(cfg["text_config"], **TEXT[model_type])
    cfg["architectures"] = [causal[model_type]]
    return cfg


def _last_frame(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    path = f.filename.split("site-packages/")[-1].split("/src/")[-1]
    return f"{path}:{f.lineno} {f.name}"


def _pct(a: float, b: float) -> float | None:
    return round(100.0 * (a - b) / b, 2) if b else None


def run_type(model_type: str, lora: bool) -> dict:
    """Estimate and trace one type; the row of the table."""
    import trainmem
    t0 = time.perf_counter()
    row: dict = {"type": model_type}
    stage = "config"
    try:
        cfg = tiny_config(model_type)
        row["class"] = cfg["architectures"][0]
        stage = "estimate"
        est = trainmem.estimate(cfg, **SETUP)
        stage = "trace"
        tr = trainmem.trace(cfg, **SETUP)
        row.update(status="OK", estimate_peak=est.peak_allocated, trace_peak=tr.peak_allocated,
                   peak_pct=_pct(est.peak_allocated, tr.peak_allocated),
                   reserved_pct=_pct(est.peak_reserved, tr.peak_reserved))
        if lora:
            stage = "lora"
            el = trainmem.estimate(cfg, lora_rank=8, **SETUP)
            tl = trainmem.trace(cfg, lora_rank=8, **SETUP)
            row["lora_peak_pct"] = _pct(el.peak_allocated, tl.peak_allocated)
    except trainmem.TrainmemError as e:
        row.update(status="REFUSED", stage=stage, message=str(e).splitlines()[0][:300] if str(e) else "")
    except Exception as e:  # noqa: BLE001 - the sweep records every other failure
        # the sweep's own tiny config that transformers rejects is no verdict on trainmem: NO-CONFIG
        row.update(status="NO-CONFIG" if stage == "config" else "CRASH", stage=stage, error=type(e).__name__,
                   message=str(e).replace("\n", " ")[:300], frame=_last_frame(e))
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def worker(lora: bool) -> None:
    """Read type names from stdin, one per line; write each row as one JSON line."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import warnings
    import logging
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import trainmem  # noqa: F401 - imported before the first timer
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        row = run_type(line.strip(), lora)
        print(json.dumps(row), flush=True)


class Pool:
    """One worker process; restarted after a timeout."""

    def __init__(self, lora: bool, cache: str):
        self.lora, self.cache, self.proc = lora, cache, None

    def start(self) -> None:
        env = dict(os.environ, TRAINMEM_CACHE=self.cache, PYTHONPATH=os.path.join(ROOT, "src"))
        args = [sys.executable, __file__, "--worker"] + (["--lora"] if self.lora else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self._read(300)

    def _read(self, timeout: float) -> dict | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not r:
                break
            line = self.proc.stdout.readline()
            if not line:
                return {"status": "CRASH", "error": "worker died", "message": f"exit {self.proc.wait()}"}
            if line.startswith("{"):
                return json.loads(line)
        return None

    def run(self, model_type: str, timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write(model_type + "\n")
        self.proc.stdin.flush()
        row = self._read(timeout)
        if row is None or row.get("error") == "worker died":
            self.stop()
            return dict(row or {"status": "TIMEOUT", "seconds": timeout}, type=model_type)
        return row

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def save(path: str, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` into the JSON file at ``path`` (by type); the merged rows."""
    old = json.load(open(path)) if os.path.exists(path) else []
    merged = {r["type"]: r for r in old} | {r["type"]: r for r in rows}
    known = set(all_types())
    merged_rows = [merged[t] for t in sorted(merged) if t in known]
    with open(path, "w") as f:
        json.dump(merged_rows, f, indent=1)
    return merged_rows


def sweep(types: list[str], timeout: float, lora: bool = False, path: str | None = None) -> list[dict]:
    """The rows of ``types``, each run in the worker under ``timeout`` seconds (merged into ``path``
    as they come)."""
    pool = Pool(lora, tempfile.mkdtemp(prefix="trainmem-archsweep-"))
    rows = []
    try:
        for t in types:
            row = pool.run(t, timeout)
            print(f"{t:28s} {row['status']:8s} {row.get('seconds', '')!s:>6} "
                  f"{row.get('peak_pct', '')!s:>7} {row.get('message', '')[:110]}", flush=True)
            rows.append(row)
            if path:
                save(path, [row])
    finally:
        pool.stop()
    return rows


def markdown(rows: list[dict]) -> str:
    """The table: counts, then one row per type."""
    import transformers
    counts = {s: sum(r["status"] == s for r in rows) for s in ("OK", "REFUSED", "CRASH", "TIMEOUT", "NO-CONFIG")}
    out = [f"transformers {transformers.__version__}, {time.strftime('%Y-%m-%d')}, {len(rows)} types, "
           f"batch {SETUP['batch_size']} x {SETUP['seq_len']}, {SETUP['precision']}: "
           + ", ".join(f"{k} {v}" for k, v in counts.items()), "",
           "| model_type | class | status | estimate vs trace, peak allocated | reserved | note |",
           "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["type"]):
        note = r.get("message", "")
        if r["status"] in ("CRASH", "NO-CONFIG"):
            note = f"{r.get('stage')}: {r.get('error')}: {note} ({r.get('frame', '')})"
        elif r["status"] == "REFUSED":
            note = f"{r.get('stage')}: {note}"
        pct = lambda k: "" if r.get(k) is None else f"{r[k]:+.1f}%"  # noqa: E731
        note = note.replace("|", "\\|").replace("\n", " ")
        out.append(f"| {r['type']} | {r.get('class', '')} | {r['status']} | {pct('peak_pct')} | "
                   f"{pct('reserved_pct')} | {note} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--types")
    p.add_argument("--slice")
    p.add_argument("--timeout", type=float, default=90)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "architectures_sweep.json"))
    p.add_argument("--markdown")
    a = p.parse_args()
    if a.worker:
        return worker(a.lora)
    types = a.types.split(",") if a.types else all_types()
    if a.slice:
        i, n = map(int, a.slice.split("/"))
        types = types[(i - 1) * len(types) // n: i * len(types) // n]
    rows = sweep(types, a.timeout, a.lora, a.json)
    merged_rows = save(a.json, rows)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(merged_rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
