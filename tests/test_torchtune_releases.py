"""torchtune's releases: ``--framework torchtune --framework-version V`` sets the loss, the loop's
hold on the logits and the FSDP version of release V, and the RoPE cache its builders keep:
``--rope-cache N`` (one module the layers share) or ``--layer-rope-cache N`` (one per layer), from
``spec.frameworks.TORCHTUNE_BUILDERS``.

The expected values are what torchtune's own builders make: built on the meta device under
``set_default_dtype(bf16)`` with each ``rope_init`` then run on the CPU (as the recipes do after a meta
build), torchtune 0.3.0, 0.5.0 and 0.6.1 (wheels installed under /tmp with ``pip --target``, never
in the project) kept these distinct fp32 ``cache`` buffers (docs/validation.md, 2026-11-25, torchtune
releases): e.g. ``llama3_1_8b`` 32 x [131072, 64, 2] at 0.3.0 and 1 at 0.5.0; ``mistral_7b`` 32 x
[32768, 64, 2] at 0.5.0 and 1 at 0.6.1; ``lora_mistral_7b`` 32 at both; ``qwen2_0_5b`` 24 x
[32768, 128] (cos and sin over the whole head_dim: 65536 positions in trainmem's layout).
``test_builders_of_an_installed_torchtune`` rebuilds them when such an install is there."""
import json
import os
import subprocess
import sys

import pytest

from trainmem.spec.resolve import resolve

SETUP = dict(batch_size=2, seq_len=1024, gpu="h100-80gb")


def _rope(name, version, lora=0, **kw):
    t = resolve(name, framework="torchtune", framework_version=version, **(dict(lora_rank=lora) if lora else {}),
                **SETUP, **kw).training
    return t.rope_cache, t.layer_rope_cache


@pytest.mark.parametrize("name, version, lora, shared, per_layer", [
    ("llama-2-7b", "0.5.0", 0, None, 4096),      # llama2(): one layer deep-copied (_get_clones)
    ("llama-2-7b", "0.6.1", 0, 4096, None),      # a loop around one rope
    ("llama-2-7b", "0.6.1", 8, None, 4096),      # lora_llama2_self_attention builds its own
    ("llama-3.1-8b", "0.3.0", 0, None, 131072),
    ("llama-3.1-8b", "0.3.0", 8, None, 131072),
    ("llama-3.1-8b", "0.3.1", 8, 131072, None),  # llama3_1 shares its Llama3ScaledRoPE from 0.3.1
    ("llama-3.2-3b", "0.4.0", 0, 131072, None),
    ("llama-3.3-70b", "0.6.1", 8, 131072, None),  # llama3_3 builds with llama3_1's builders
    ("mistral-7b", "0.5.0", 0, None, 32768),
    ("mistral-7b", "0.6.1", 0, 32768, None),
    ("mistral-7b", "0.6.1", 8, None, 32768),
    ("qwen2.5-0.5b", "0.6.1", 8, None, 65536),   # Qwen2's [max_seq_len, 2 x head_dim] cache
    ("qwen2.5-0.5b", "0.6.1", 0, 65536, None),
    ("qwen2.5-7b", "0.5.0", 0, None, 262144),    # qwen2_5_7b_base: max_seq_len 131072
])
def test_the_preset_sets_the_builders_rope_cache(name, version, lora, shared, per_layer):
    assert _rope(name, version, lora) == (shared, per_layer)


def test_the_current_release_is_0_6_1():
    assert _rope("mistral-7b", None, 8) == _rope("mistral-7b", "0.6.1", 8)
    assert _rope("mistral-7b", "0.6", 0) == (32768, None)
    assert _rope("llama-3.1-8b", "0.3", 8) == (None, 131072)   # 0.3 is 0.3.0


def test_a_given_cache_is_kept_and_drops_the_other():
    assert _rope("llama-3.2-3b", "0.6.1", layer_rope_cache=1024) == (None, 1024)
    assert _rope("llama-2-7b", "0.5.0", rope_cache=1024) == (1024, None)


def test_a_shared_cache_is_not_set_under_pipeline_parallelism():
    """--rope-cache is refused with --pp (the stages would split the one module); torchtune runs no
    pipeline, so the preset leaves it out there."""
    assert _rope("llama-3.2-3b", "0.6.1", pp=2, dp=1) == (None, None)


def _warnings(name, version=None, **kw):
    return resolve(name, framework="torchtune", framework_version=version, **SETUP, **kw).training.extra[
        "framework_warnings"]


def test_models_no_builder_makes_are_said_not_counted():
    """Mistral NeMo (max_position_embeddings 1024000) has no torchtune builder; Llama 3.2 came in 0.3.1;
    the Qwen2.5 base builders (131072 positions) in 0.4.0."""
    for name, version in (("mistral-nemo-12b", None), ("llama-3.2-1b", "0.2.1"), ("qwen2.5-7b", "0.3.0")):
        assert _rope(name, version) == (None, None)
        assert any("its RoPE cache is not counted" in w for w in _warnings(name, version))
    assert not any("RoPE" in w for w in _warnings("llama-3.2-1b", "0.3.1"))


def test_derived_architectures_say_what_is_not_counted():
    """Gemma-2 and Phi-3 are derived (transformers' buffers): one line with the builder's bytes,
    26 x 8 MiB for lora_gemma2_2b ([8192, 128, 2] fp32 per layer), 3 MiB for phi3_mini ([4096, 192])."""
    (g,) = [w for w in _warnings("gemma-2-2b", lora_rank=8) if "RoPE" in w]
    assert "26 layers (208 MiB)" in g
    (p,) = [w for w in _warnings("phi-3-mini") if "RoPE" in w]
    assert "one fp32 RoPE cache (3 MiB)" in p


PROBE = r"""
import sys, importlib, json, types, importlib.abc, importlib.machinery
STUB = {"datasets", "tiktoken", "sentencepiece", "blobfile", "omegaconf", "kagglehub", "huggingface_hub",
        "safetensors", "PIL", "lm_eval", "wandb", "psutil", "tokenizers", "jinja2"}
class _Any(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"): raise AttributeError(name)
        m = _Any(f"{self.__name__}.{name}"); m.__path__ = []
        return type(name, (), {}) if name[:1].isupper() else m
    def __call__(self, *a, **k): return None
MISSING = {n for n in STUB if importlib.machinery.PathFinder.find_spec(n) is None}
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in MISSING: return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Any(spec.name); m.__path__ = []; return m
    def exec_module(self, m): pass
sys.meta_path.insert(0, Finder())
import torch, torchtune
from torchtune import training
out = {"version": torchtune.__version__}
for spec in sys.argv[1:]:
    mod, fn = spec.rsplit(".", 1)
    f = getattr(importlib.import_module("torchtune.models." + mod), fn)
    with training.set_default_dtype(torch.bfloat16), torch.device("meta"):
        m = f(["q_proj", "v_proj"], lora_rank=8, lora_alpha=16) if fn.startswith("lora_") else f()
    with training.set_default_dtype(torch.bfloat16), torch.device("cpu"):
        for mm in m.modules():
            if hasattr(mm, "rope_init"): mm.rope_init()
    seen = {id(b): b.numel() * b.element_size() for n, b in m.named_buffers(remove_duplicate=False)
            if n.endswith("pos_embeddings.cache")}
    out[spec] = sorted(seen.values())
print(json.dumps(out))
"""

SITES = [p for p in os.environ.get("TRAINMEM_TORCHTUNE_SITES", "/tmp/ttarch/site").split(os.pathsep)
         if os.path.isdir(os.path.join(p, "torchtune"))]
CASES = [("llama2.llama2_7b", "llama-2-7b", 0), ("llama2.lora_llama2_7b", "llama-2-7b", 8),
         ("llama3_1.llama3_1_8b", "llama-3.1-8b", 0), ("llama3_1.lora_llama3_1_8b", "llama-3.1-8b", 8),
         ("mistral.mistral_7b", "mistral-7b", 0), ("mistral.lora_mistral_7b", "mistral-7b", 8),
         ("qwen2.qwen2_0_5b", "qwen2.5-0.5b", 0), ("qwen2.lora_qwen2_0_5b", "qwen2.5-0.5b", 8)]


@pytest.mark.slow
@pytest.mark.skipif(not SITES, reason="no torchtune install under TRAINMEM_TORCHTUNE_SITES (pip --target)")
@pytest.mark.parametrize("site", SITES)
def test_builders_of_an_installed_torchtune(site):
    """Builds torchtune's own builders (a ``pip install --target`` of any release; torchao beside it)
    and checks that the caches they keep are the preset's at that release: count x bytes."""
    from trainmem.spec.config import resolve_model
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, "/tmp/ttarch/site"]))
    run = subprocess.run([sys.executable, "-c", PROBE, *[c[0] for c in CASES]], env=env, cwd="/tmp",
                         capture_output=True, text=True, timeout=600)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for spec, name, lora in CASES:
        shared, per_layer = _rope(name, got["version"].split("+")[0], lora)
        m = resolve_model(name)
        each = (shared or per_layer) * (m.head_dim // 2) * 2 * 4   # fp32 [N, head_dim/2, 2]
        assert got[spec] == [each] * (1 if shared else m.num_layers), spec


@pytest.mark.parametrize("version, loss, chunks, cast, hold, fsdp_version", [
    ("0.1.0", "upcast", 1, True, "step", 1),   # nn.CrossEntropyLoss on output(h).float(), logits kept, FSDP1
    ("0.2.1", "upcast", 1, True, "step", 1),
    ("0.3.0", "chunked", 8, False, "loss", 2),  # CEWithChunkedOutputLoss, del logits, fully_shard
    ("0.6.1", "chunked", 8, False, "loss", 2),
])
def test_the_loss_and_the_sharding_follow_the_release(version, loss, chunks, cast, hold, fsdp_version):
    """Up to 0.2 the configs' loss is torch.nn.CrossEntropyLoss (recipes/configs/llama3/8B_full.yaml L57
    at v0.2.1) on the decoder's fp32 output (transformer.py L250), whose shifted copy the loop keeps
    until the next forward (full_finetune_distributed.py L519-529: no ``del logits``), and the
    distributed recipes wrap with FSDP1 (L319-326); from 0.3.0 the chunked loss over 8 bf16 chunks
    (L231), ``del logits`` (L642) and FSDP2."""
    t = resolve("llama-2-7b", framework="torchtune", framework_version=version, dp=4, **SETUP).training
    assert (t.loss, t.loss_chunks, t.cast_output, t.hold_output, t.fsdp, t.fsdp_version) == (
        loss, chunks, cast, hold, "full", fsdp_version)



HAND_MAPPED = ("torchtune_readme_llama2_7b_full_fsdp4_b4_s2048", "torchtune_readme_llama2_7b_lora_b4_s2048",
               "torchtune_tut_llama2_7b_lora_all_r64", "torchtune_tut_llama2_7b_lora_all_r8",
               "torchtune_tut_llama2_7b_lora_qv_r64", "torchtune_tut_llama2_7b_lora_qv_r8")
RUN_OPTIONS = ("batch_size", "seq_len", "grad_accum", "dp", "lora_rank", "lora_targets", "recompute", "gpu", "optimizer",
               "min_seq_len", "attention")


@pytest.mark.parametrize("case", HAND_MAPPED)
def test_the_0_1_preset_is_the_hand_mapping_of_the_llama2_fixtures(case):
    """The six torchtune 0.1-era fixtures (README table of May 2024 at 0217d44c2, LoRA tutorial at
    ff594c231) were mapped by hand from the recipes (loss upcast, cast_output, hold_output step,
    layer_rope_cache 4096, FSDP1, lora_dtype half, the optimizer's default implementation).
    ``--framework torchtune --framework-version 0.1.0`` with only the run's own options (batch,
    sequence, LoRA, recompute, GPU, the data's shortest batch) gives every one of those options;
    it also says torchtune's decoder builds no KV cache (``use_cache`` false)."""
    import dataclasses
    from pathlib import Path
    d = json.loads((Path(__file__).parents[1] / "validation" / "published" / f"{case}.json").read_text())
    hand = resolve(d["model"], use_cache=False, **d["setup"]).training
    run = {k: v for k, v in d["setup"].items() if k in RUN_OPTIONS}
    preset = resolve(d["model"], framework="torchtune", framework_version="0.1.0", **run).training
    differ = {f.name for f in dataclasses.fields(hand) if f.name != "extra"
              and getattr(hand, f.name) != getattr(preset, f.name)}
    assert differ == set()


@pytest.mark.parametrize("version, torch, refused", [
    ("0.2.1", None, True),     # recipes: model.compile(backend=backend)
    ("0.3.1", "2.4", True),    # training.compile_model: the whole model before PyTorch 2.5
    ("0.3.1", "2.5", False),   # ... each layer from 2.5
    ("0.4.0", None, False),    # the installed PyTorch
    ("0.5.0", "2.4", False),   # each layer only
])
def test_a_whole_model_compile_is_refused(version, torch, refused):
    """trainmem models torchtune's per-layer compile; a release that compiles the whole model (the
    head and the embedding in the graph) is refused in one line, not estimated as per-layer."""
    from trainmem.errors import TrainmemError
    kw = dict(framework="torchtune", framework_version=version, torch_version=torch, compile=True, **SETUP)
    if refused:
        with pytest.raises(TrainmemError) as e:
            resolve("llama-3.2-1b", **kw)
        assert "--compile" in str(e.value) and "\n" not in str(e.value)
    else:
        assert resolve("llama-3.2-1b", **kw).training.compile
