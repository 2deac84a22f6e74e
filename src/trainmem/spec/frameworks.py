"""Framework presets: the training options a framework's current release sets, each with its source.

``--framework NAME`` applies one :class:`Preset`: its option values first, the user's explicit
options on top (``spec.resolve``). A preset holds, per option, a :class:`Cell`: the value it sets
(None: it sets nothing and trainmem's default stays, with the reason in ``shown``/``note``), the
source lines it was read from (``Source``: a file and lines at a release tag or commit of
``REPOS``) and what trainmem models differently. Defaults that changed between releases are
version rules (``Since``) chosen by ``--framework-version``; values that depend on the rest of the
setup (torchtitan's precision follows its parallelism) or on the model (transformers >= 5 loads a
checkpoint in its own dtype) come from the preset's ``rules``; ``check`` names, in one line each,
what in a setup the framework does not run or trainmem does not count. ``docs/frameworks.md``
carries ``markdown_table()`` (tests/test_frameworks.py keeps the two equal).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import TrainmemError
from .releases import SDPA_ATTENTION, cuda_reads_pytorch_alloc_conf, parse_torch_version
from .training import BNB_OPTIMIZERS, chunked_nll_problem, default_seq_len

#: the repository and the release tag (or commit) every cited line is read at
REPOS: dict[str, tuple[str, str]] = {
    "torch": ("pytorch/pytorch", "v2.13.0"),
    "transformers": ("huggingface/transformers", "v5.23.0"),
    "transformers-4.31": ("huggingface/transformers", "v4.31.0"),
    "transformers-4.32": ("huggingface/transformers", "v4.32.0"),
    "transformers-4.45": ("huggingface/transformers", "v4.45.2"),
    "transformers-4.48": ("huggingface/transformers", "v4.48.0"),
    "transformers-4.49": ("huggingface/transformers", "v4.49.0"),
    "transformers-4.54": ("huggingface/transformers", "v4.54.0"),
    "transformers-5.0": ("huggingface/transformers", "v5.0.0"),
    "trl": ("huggingface/trl", "v1.9.0"),
    "trl-0.12": ("huggingface/trl", "v0.12.0"),
    "trl-0.19": ("huggingface/trl", "v0.19.0"),
    "trl-0.21": ("huggingface/trl", "v0.21.0"),
    "trl-0.22": ("huggingface/trl", "v0.22.0"),
    "accelerate": ("huggingface/accelerate", "v1.15.0"),
    "accelerate-main": ("huggingface/accelerate", "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83"),
    "torchtune": ("pytorch/torchtune", "v0.6.1"),
    "torchtune-0.2": ("pytorch/torchtune", "v0.2.1"),
    "torchtune-0.3": ("pytorch/torchtune", "v0.3.0"),
    "torchtune-0.3.1": ("pytorch/torchtune", "v0.3.1"),
    "torchtitan": ("pytorch/torchtitan", "v0.2.2"),
    "lightning": ("Lightning-AI/pytorch-lightning", "2.6.5"),
    "litgpt": ("Lightning-AI/litgpt", "v0.5.13"),
    "nanogpt": ("karpathy/nanoGPT", "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"),
    "deepspeed": ("deepspeedai/DeepSpeed", "v0.19.5"),
    "megatron": ("NVIDIA/Megatron-LM", "core_v0.19.0"),
    "unsloth": ("unslothai/unsloth", "March-2026"),
    "unsloth-zoo": ("unslothai/unsloth-zoo", "38f4871f9c866ea15f4a2baa32685da957eb7b0e"),
}

#: presets whose loop trains the framework's own model code, not the model's transformers class
#: (torchtune's and torchtitan's ``Transformer``, litgpt's ``GPT``, nanoGPT's ``GPT``, Megatron's ``GPTModel``)
OWN_MODEL_CODE = frozenset({"torchtune", "torchtitan", "litgpt", "nanogpt", "megatron"})
#: the options a preset speaks for, in the table's order (``sharding`` is ``fsdp``/``zero``/
#: ``distributed_optimizer``)
COLUMNS = ("precision", "master_weights", "optimizer_impl", "zero_grad", "hold_output", "loss", "attention",
           "recompute", "sharding", "grad_sync", "dropout")
#: options a user gives together: giving one drops the preset's value for the others
LINKED = (("recompute", "recompute_every"), ("loss", "loss_chunks"), ("zero", "fsdp"), ("rope_cache", "layer_rope_cache"),
          ("hold_output", "keep_logits"))
#: cells shown inside another column's cell
_WITHIN = {"loss": ("loss_chunks",), "recompute": ("recompute_every",)}


@dataclass(frozen=True)
class Source:
    """Lines of one file at ``REPOS[repo]``'s tag or commit."""

    repo: str
    path: str
    lines: str  # "806" or "806-811"

    @property
    def text(self) -> str:
        return f"{self.path.rsplit('/', 1)[-1]}:{self.lines}"

    @property
    def url(self) -> str:
        name, ref = REPOS[self.repo]
        first, _, last = self.lines.partition("-")
        return f"https://github.com/{name}/blob/{ref}/{self.path}#L{first}" + (f"-L{last}" if last else "")


@dataclass(frozen=True)
class Cell:
    """One option of one preset: the value it sets (None: none, trainmem's default stays), its
    sources, the table's text when the value depends on the setup or is not set, and a note."""

    value: Any = None
    sources: tuple[Source, ...] = ()
    shown: str = ""
    note: str = ""
    option: str = ""  # the TrainingSpec field, when it is not the column's name


@dataclass(frozen=True)
class Since:
    """From ``version`` on (until the next rule), ``option`` is ``value``."""

    option: str
    version: str
    value: Any
    source: Source


@dataclass(frozen=True)
class Preset:
    """A framework's defaults as ``TrainingSpec`` options."""

    name: str
    title: str
    release: str                # what the cells were read from, e.g. "transformers 5.23.0"
    cells: Mapping[str, Cell]
    since: tuple[Since, ...] = ()         # version rules, ascending per option
    oldest: str | None = None            # oldest --framework-version (None: no version rules)
    rules: Callable[[Mapping[str, Any], Any, tuple[int, ...] | None], dict[str, Any]] | None = None
    check: Callable[[Any, Any, tuple[int, ...] | None, frozenset[str]], list[str]] | None = None
    notes: tuple[str, ...] = field(default=())
    # options whose cell is PyTorch's own default as the framework calls it (``zero_grad()`` with no
    # argument, ``foreach=None``, sdpa where torch has it): an older --torch-version changes them
    # (``spec.releases.torch_defaults``); the other cells are the framework's explicit choices
    torch_derived: tuple[str, ...] = ()
    min_torch: str | None = None  # the oldest PyTorch the framework's current release runs on

    @property
    def current(self) -> str:
        return self.release.rsplit(" ", 1)[-1]


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _dtype_precision(model: Any) -> str | None:
    """The precision of a model trained as ``from_pretrained(dtype="auto")`` loads it with no
    autocast: its config's ``dtype``/``torch_dtype`` (None when the config names none)."""
    config = getattr(model, "config", None) or {}
    dtype = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype).replace("torch.", ""))


def _half_master(view: Mapping[str, Any]) -> dict[str, Any]:
    """An fp32 master copy beside bf16/fp16 weights (DeepSpeed's and Megatron's optimizers)."""
    return {"master_weights": "fp32"} if view.get("precision") in ("bf16", "fp16") else {}


def _zero3_init(view: Mapping[str, Any]) -> dict[str, Any]:
    """``--zero-init on`` under DeepSpeed ZeRO-3 for the frameworks that build the model inside
    ``deepspeed.zero.Init`` themselves: transformers' ``from_pretrained`` enters it when a ZeRO-3
    config is registered (``is_deepspeed_zero3_enabled()``; transformers 5.24.0 ``modeling_utils.py``
    ``get_init_context`` L3812-3830), which ``TrainingArguments(deepspeed=...)`` does
    (``training_args.py`` L1710-1715: ``HfTrainerDeepSpeedConfig``) and Accelerate's ``DeepSpeedPlugin``
    does when ``zero3_init_flag`` is on, its default for stage 3 (accelerate v1.14.0
    ``utils/dataclasses.py`` L1325-1337). A model loaded before those objects exist is built whole:
    give ``--zero-init off`` then."""
    if view.get("zero") == 3 and view.get("fsdp") is None:
        return {"zero_init": "on"}
    return {}


def _hf_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """The Trainer's rules: ``zero.Init`` under ZeRO-3 (:func:`_zero3_init`) and the model's (below)."""
    return {**_zero3_init(view), **_hf_model_rules(view, model, version)}


def _hf_model_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """transformers >= 5: ``from_pretrained`` loads the checkpoint's dtype, and ``bf16=False``
    adds no autocast: a bf16 checkpoint trains in pure bf16.

    QLoRA (a 4-bit base through transformers' ``BitsAndBytesConfig``): peft's
    ``prepare_model_for_kbit_training`` (``src/peft/utils/other.py`` L130-215; TRL's SFTTrainer
    calls it on every 4-bit model) casts each fp16/bf16 parameter that is not a ``Params4bit`` to
    fp32 (embeddings, norms, an untied head), and ``TrainingArguments(bf16=True)`` runs the step
    under autocast: trainmem's ``bf16-amp`` (``fp16-amp`` for an fp16 checkpoint) over the 4-bit
    base. (Axolotl patches the cast away; give ``--precision`` then.)

    transformers 4.x: ``gradient_checkpointing=True`` checkpoints with ``use_reentrant=True`` unless
    ``gradient_checkpointing_kwargs`` say otherwise (4.48.1 ``modeling_utils.py`` L2539, 4.56.0 L3810;
    5.0.0 L3099 defaults to False): ``--recompute full`` on every layer is ``--reentrant`` there."""
    out: dict[str, Any] = {}
    if version is not None and version < (5,) and view.get("recompute") == "full" \
            and (view.get("recompute_every") or 1) == 1:
        out["reentrant"] = True
    if view.get("quantize") and view.get("quantize_via", "transformers") == "transformers":
        return {**out, "precision": "fp16-amp" if _dtype_precision(model) == "fp16" else "bf16-amp"}
    if version is not None and version < (5,):
        return out
    p = _dtype_precision(model)
    return {**out, "precision": p} if p else out


def _lightning_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """With ``--zero`` (``strategy="deepspeed_stage_N"``) Lightning's ``DeepSpeedStrategy`` passes its
    own ``zero_optimization`` values, not DeepSpeed's defaults: buckets of 2e8 elements, ``overlap_comm``
    and ``contiguous_gradients`` on, ``sub_group_size`` 1e12 (lightning 2.4.0
    ``src/lightning/pytorch/strategies/deepspeed.py`` L96-102, the same in Fabric's strategy L74-80)."""
    zero = view.get("zero") or 0
    if not zero or view.get("fsdp") is not None:
        return _lightning_ddp_stream(view, version)
    out: dict[str, Any] = {"reduce_bucket_size": 200_000_000, "overlap_comm": True}
    if zero == 3:
        out["sub_group_size"] = 1_000_000_000_000
    return out


def _lightning_ddp_stream(view: Mapping[str, Any], version: tuple[int, ...] | None) -> dict[str, Any]:
    """Plain DDP (``strategy="ddp"``, ``--dp`` > 1 alone): from 2.1.0 to 2.6.5 Lightning's ``DDPStrategy``
    builds ``DistributedDataParallel`` inside ``torch.cuda.stream(torch.cuda.Stream())`` (Lightning
    PR #17334, 524608ce53, 2023-04-24, first in 2.1.0; 2.6.5 ``src/lightning/pytorch/strategies/ddp.py``
    ``_setup_model`` and Fabric's ``setup_module``): ``--ddp-init-stream side``. The default stream since
    PR #21746 (35e56ef935, 2026-06-01, after 2.6.5, in no release yet), and before 2.1.0: current."""
    plain = (view.get("dp") or 1) > 1 and view.get("fsdp") is None and not view.get("zero") \
        and view.get("gemini") is None and (view.get("pp") or 1) == 1 and not view.get("distributed_optimizer")
    return {"ddp_init_stream": "side"} if plain and (version is None or version >= (2, 1)) else {}


def _trl_chunked(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> bool:
    """Whether the run computes TRL's chunked_nll by default: from 1.7, on a causal LM, unless the
    loss is given (``--loss``: loss_type, or Liger's ``--loss fused``)."""
    return (version is None or version >= (1, 7)) and getattr(model, "head", "") == "causal-lm" \
        and view.get("loss") in (None, "chunked-nll") and view.get("loss_chunks", 1) == 1 \
        and not view.get("liger") and not view.get("trainer")
    # (use_liger_kernel: Liger's loss, sft_config.py L335-336 at v1.9.0; DPOTrainer computes its own log-probs)


def _trl_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """What TRL's SFTTrainer does besides the table's cells. From 0.22 its ``compute_loss`` passes
    ``use_cache=False`` to the model (trl/trainer/sft_trainer.py L1710 at v1.9.0, L1040 at v0.22.0):
    no KV cache. QLoRA (a model transformers loaded in 4 bits): from 0.26 every trainable parameter
    (the adapters) is cast to bf16 after ``get_peft_model`` (sft_trainer.py L1127-1130 at v1.9.0, L718
    at v0.26.0): ``--lora-dtype half``. Before, peft's ``autocast_adapter_dtype`` keeps them fp32:
    0.12-0.21 run ``prepare_model_for_kbit_training`` (the weights that are not 4-bit to fp32) and,
    with bf16, ``peft_module_casting_to_bf16`` (utils.py L842-849 at v0.12.0), which casts norms to
    fp32 and the embeddings and head back to bf16 but leaves the adapters alone (``--half-embeddings``
    when the preset's precision is bf16-amp, from 0.19); 0.22-0.25 cast nothing. From 1.7
    ``loss_type`` defaults to ``chunked_nll`` (sft_config.py L335-336 at v1.9.0): ``--loss chunked-nll``
    where the estimate models it (``training.chunked_nll_problem``: not a derived architecture);
    elsewhere the model's own loss stays, with a warning. Gradient checkpointing: from 0.27 SFTConfig
    sets ``use_reentrant=False`` when transformers is older than 5.0 (trl/trainer/sft_config.py
    L281-287 at v0.27.0, commit 40d8759d1; sft_trainer.py L975-981 at v1.0.0), so ``--no-reentrant``
    where transformers' own default would be reentrant (``TrainingSpec.checkpoint_reentrant``); from
    0.28 a PEFT model under DeepSpeed ZeRO-3 is forced back to ``use_reentrant=True`` (sft_trainer.py
    L793-809 at v1.0.0, commit f11b4c3fd)."""
    out: dict[str, Any] = _zero3_init(view)
    if view.get("trainer") == "dpo" and version is not None and version < (0, 29):
        raise TrainmemError(f"--trainer dpo with --framework-version {'.'.join(map(str, version))}: TRL's DPOTrainer "
                            "before 0.29 (concatenated_forward, the reference's log-probs first) is not modelled; "
                            "trainmem models the one of 0.29 to 1.9 (\"Refactor DPO\", huggingface/trl#3906)")
    if version is None or version >= (0, 22):
        out["use_cache"] = False
    if (version is None or version >= (0, 27)) and view.get("recompute") == "full":
        peft_zero3 = bool(view.get("lora_rank")) and view.get("zero") == 3 and (version is None or version >= (0, 28))
        out["reentrant"] = peft_zero3
    if _trl_chunked(view, model, version) and chunked_nll_problem(
            model, bool(view.get("quantize")) and view.get("quantize_via") == "fabric") is None:
        out["loss"] = "chunked-nll"
    quantized = view.get("quantize") and view.get("quantize_via", "transformers") == "transformers"
    if quantized and view.get("lora_rank") and (version is None or version >= (0, 26)):
        out["lora_dtype"] = "half"
    if quantized and view.get("lora_rank") and version is not None and version < (0, 22) \
            and view.get("precision") == "bf16-amp":
        out["half_embeddings"] = True  # (peft_module_casting_to_bf16 runs with args.bf16 only)
    return out


def _accelerate_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """``mixed_precision="no"``: the model as loaded (transformers >= 5: the checkpoint's dtype)."""
    p = _dtype_precision(model)
    return {**_zero3_init(view), **({"precision": p} if p else {})}


def _litgpt_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """What litgpt's finetune scripts (v0.5.13) run besides the table's cells. Its own model code
    (``litgpt/model.py``): q, k and v from one fused linear (L394, L472: ``--fused-qkv`` where
    transformers' class has them apart), grouped keys and values repeated to the query heads before
    SDPA with ``is_causal`` and no mask (L533-539, L593-595: ``--attention-call repeat-kv``), the MLP's
    gate and up projections apart (``LLaMAMLP`` fc_1, fc_2: ``--split-gate-up`` where transformers
    fuses them), no KV cache in training (``use_cache`` false), and under
    LoRA the head computed in 128-token chunks (``model(input_ids, lm_head_chunk_size=128)``,
    finetune/lora.py L355, model.py L177-179: ``--loss-chunks`` ceil(seq/128)). Lightning Fabric
    hands the loop an fp32 copy of a half output (``_FabricModule.forward``: ``convert_output``) under
    every half or mixed precision (``--cast-output``). LoRA's defaults (lora.py L56-64): dropout 0.05,
    adapters built in the weights' dtype by ``fabric.init_module`` (L209-210), on query and value
    but not key (``lora_query=True, lora_key=False, lora_value=True``, L59-61: ``--lora-qkv q,v`` on a
    model that fuses them itself, GPT-NeoX and Falcon). With ``--dp`` > 1 the
    LoRA script shards with FSDP2 and checkpoints every block (``ModelParallelStrategy`` and
    ``parallelize_fn``, L152-166, L522-543), the full script with FSDP1 (``FSDPStrategy(auto_wrap_policy=
    {Block}, activation_checkpointing_policy={Block})``, finetune/full.py L107-114). With ``--quantize``
    Fabric's ``BitsandbytesPrecision`` quantizes (L141-150) and the optimizer is bitsandbytes'
    ``PagedAdamW`` (L218-219, utils.py L619-633)."""
    out: dict[str, Any] = {"use_cache": False, "cast_output": view.get("precision") != "fp32"}
    modules = {p.module for p in model.parameter_tensors()} if model is not None else set()
    single = view.get("tp", 1) == 1 and view.get("pp", 1) == 1
    if {"q_proj", "k_proj", "v_proj"} <= modules and single:
        out["fused_qkv"] = True
    if "gate_up_proj" in modules and single:
        out["split_gate_up"] = True  # LLaMAMLP's fc_1 and fc_2 where transformers fuses them (Phi-3)
    causal = model is None or (getattr(model, "head", "") == "causal-lm" and getattr(model, "family", "") != "nanogpt")
    if single and view.get("cp", 1) == 1 and not view.get("compile") and causal and \
            view.get("attention", "sdpa") in SDPA_ATTENTION:
        out["attention_call"] = "repeat-kv"  # K/V repeated to the query heads, SDPA with is_causal (L533-539, L593-595)
    lora = bool(view.get("lora_rank"))
    if lora:
        seq = view.get("seq_len") or (default_seq_len(model) if model is not None else 2048)
        out["loss_chunks"] = max(1, -(-seq // 128))
        out["lora_dropout"] = 0.05
        if view.get("precision") in ("bf16", "fp16"):
            out["lora_dtype"] = "half"
        targets = view.get("lora_targets") or ()
        if "query_key_value" in modules and "query_key_value" in (targets.split(",") if isinstance(targets, str)
                                                                 else targets):
            out["lora_qkv"] = "q,v"  # LoRAQKVLinear on the model's fused linear: lora_query, lora_value (L59-61)
    if view.get("quantize"):
        out.update(quantize_via="fabric", optimizer="paged-adamw")
    if view.get("fsdp") is None and not view.get("zero") and _sharded(view):
        out.update(fsdp="full", fsdp_version=2 if lora else 1, recompute="full")
    return out


def _sharded(view: Mapping[str, Any]) -> bool:
    return view.get("dp", 1) > 1 or view.get("cp", 1) > 1


def _torchtitan_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """FSDP2 over every data-parallel rank (``data_parallel_shard_degree=-1``), resharding after
    forward unless pipelined, with its split root units on an untied model (``_split_root_units``);
    under 1F1B and GPipe its weighted stage split (the embeddings and the head one layer each); its MixedPrecisionPolicy is the precision when FSDP is on, else
    autocast (DDP or one GPU) or none (TP/PP without FSDP). torchtitan trains its own model code,
    which builds no KV cache (transformers' builds a DynamicCache unless ``use_cache`` is off)."""
    out: dict[str, Any] = {"use_cache": False}  # its own Transformer (models/llama3/model/model.py) has no KV cache
    if view.get("pp", 1) > 1 and view.get("pp_schedule") in (None, "1f1b", "gpipe"):
        # its stage split counts the embeddings and the final norm + output as one layer each
        # (job_config.py L377-387 pipeline_parallel_first/last_stage_less_layers = 1; pipeline_parallel.py
        # L236-344 generate_llm_fqn_per_model_part; spec.layout.stage_layer_counts). Under the interleaved
        # schedules a rank's stages then differ in layers, which trainmem does not model: left even there
        out.update(pp_first_stage_less_layers=1, pp_last_stage_less_layers=1)
    fsdp = view.get("fsdp")
    if fsdp is None and view.get("zero") is None and _sharded(view):  # --zero 0 given: replicated (DDP)
        fsdp = out["fsdp"] = "grad-op" if view.get("pp", 1) > 1 else "full"
    if fsdp is not None:
        out["precision"] = "bf16-mp"
        if _split_root_units(view, fsdp, model):
            out["fsdp_gathered"] = "head"
    elif view.get("tp", 1) > 1 or view.get("pp", 1) > 1:
        out["precision"] = "fp32"
    else:
        out["precision"] = "bf16-amp"
    if view.get("torch_version") is not None \
            and not cuda_reads_pytorch_alloc_conf(parse_torch_version(view["torch_version"])):
        # run_train.sh sets only PYTORCH_ALLOC_CONF (L42 at v0.2.2; since e629fe58a, 2025-08-15), which
        # the CUDA allocator of 2.9 does not read (spec.releases.cuda_reads_pytorch_alloc_conf)
        out["expandable_segments"] = False
    return out


def _split_root_units(view: Mapping[str, Any], fsdp: str, model: Any) -> bool:
    """Whether torchtitan's ``apply_fsdp`` (0.2.0 on, from 83e694105 of 2025-07-28; v0.2.2
    ``torchtitan/models/llama3/infra/parallelize.py`` L333-357) splits the root here: the embedding
    its own unit, ``[norm, output]`` one unit kept gathered (``--fsdp-gathered head``), for FSDP2
    resharding after forward without a pipeline, on an untied decoder-only causal LM (a tied head is
    not modelled: ``spec.training.fsdp2_split_root_problem``)."""
    return (fsdp in ("full", "hybrid") and view.get("fsdp_version", 2) == 2 and view.get("pp", 1) == 1
            and not view.get("lora_rank")
            and model is not None and not getattr(model, "tied_embeddings", True)
            and not getattr(model, "is_encoder_decoder", False) and getattr(model, "head", "") == "causal-lm")


def _torchtune_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """full_finetune_distributed shards every rank's model with FSDP2 (reshard after forward). The
    LoRA recipes build the model, adapters included, in the recipe's dtype
    (recipes/lora_finetune_single_device.py ``_setup_model``: ``with training.set_default_dtype(
    self._dtype), self._device: model = config.instantiate(cfg_model)``): half adapters. torchtune's
    ``TransformerDecoder`` has KV caches only after ``setup_caches`` (generation; torchtune/modules/
    transformer.py), so training builds none: ``use_cache`` false. Up to 0.2 the distributed recipes
    wrap with FSDP1 (``fsdp_version`` 1). The preset's fused AdamW is
    torch's; a bitsandbytes optimizer (the single-device configs' ``PagedAdamW8bit``, ``AdamW8bit``)
    has one implementation: no ``optimizer_impl`` (``workload.check_supported`` refuses one).

    Grouped-query attention: ``attention_call`` ``repeat-kv`` (``_repeats_kv``). The builder's RoPE
    cache, shared or one per layer by release and builder: ``rope_cache`` or ``layer_rope_cache``
    (``_torchtune_rope_option``).

    QLoRA (``--quantize nf4``): torchtune's ``qlora_*`` builders quantize the base weights with
    torchao's ``to_nf4`` (torchtune/modules/peft/lora.py, ``LoRALinear(quantize_base=True)``;
    torchtune/modules/low_precision/nf4_linear.py ``FrozenNF4Linear``): ``quantize_via`` torchao; the
    torchao release is the one torchtune pinned (``torchao==0.1`` in pyproject.toml at v0.1.0 and
    v0.1.1; v0.2.x pin 0.3.1; later releases pin none: a current one)."""
    out: dict[str, Any] = {"use_cache": False}
    if view.get("quantize") not in (None, "none"):
        out["quantize_via"] = "torchao"
        if version is not None and version[:2] < (0, 2) and view.get("torchao_version") is None:
            out["torchao_version"] = "0.1"
    if view.get("optimizer") in BNB_OPTIMIZERS:
        out["optimizer_impl"] = None
    if view.get("fsdp") is None and not view.get("zero") and _sharded(view):
        out["fsdp"] = "full"
        if version is not None and _release(version) < (0, 3, 0):
            # FSDP1 FULL_SHARD up to 0.2 (recipes/full_finetune_distributed.py L319-326,
            # lora_finetune_distributed.py L415-420 at v0.2.1); fully_shard (FSDP2) from 0.3.0
            # (training.shard_model, full_finetune_distributed.py L407 at v0.3.0)
            out["fsdp_version"] = 1
    if view.get("lora_rank") and view.get("lora_dtype") is None:
        out["lora_dtype"] = "half"
    if _repeats_kv(view, model):
        out["attention_call"] = "repeat-kv"
    out.update(_torchtune_rope_option(view, model, version))
    if view.get("compile") and _compiles_whole_model(view, version):
        torch = view.get("torch_version")
        raise TrainmemError(f"--compile with --framework torchtune --framework-version {'.'.join(map(str, version))}"
                            f"{f' --torch-version {torch}' if torch else ''}: that release compiles the whole model "
                            f"(model.compile()), which trainmem models only for torchtune's per-layer compile (0.5 on, "
                            f"or 0.3-0.4 on PyTorch >= 2.5); drop --compile")
    return out


def _compiles_whole_model(view: Mapping[str, Any], version: tuple[int, ...] | None) -> bool:
    """Whether torchtune's ``compile: True`` compiles the whole model at this release: up to 0.2 the
    recipes call ``model.compile(backend=backend)`` (recipes/full_finetune_single_device.py L276-279 at
    v0.2.1); 0.3.0 to 0.4.x ``training.compile_model`` compiles each ``TransformerSelfAttentionLayer``
    on PyTorch >= 2.5 and the whole model before (torchtune/training/_compile.py L45-61 at v0.4.0); from
    0.5.0 each layer only. Without ``--torch-version`` the installed PyTorch (>= 2.5) runs it."""
    if version is None:
        return False
    at = _release(version)
    if at < (0, 3, 0):
        return True
    torch = view.get("torch_version")
    return at < (0, 5, 0) and torch is not None and parse_torch_version(torch)[:2] < (2, 5)


def _torchtune_rope_option(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """The RoPE cache torchtune's builder keeps (``torchtune_rope``), as ``--rope-cache`` or
    ``--layer-rope-cache``: for the hand-written families only (a derived architecture's buffers are
    transformers', ``_check_torchtune`` says what is not counted), not where one was given, and not a
    shared cache under ``--pp`` (refused: the stages would split it)."""
    if view.get("rope_cache") is not None or view.get("layer_rope_cache") is not None \
            or model is None or getattr(model, "family", "derived") != "llama":
        return {}
    found = torchtune_rope(model, version, bool(view.get("lora_rank")))
    if found is None or (found[0] == "rope_cache" and view.get("pp", 1) > 1):
        return {}
    return {found[0]: found[1]}


@dataclass(frozen=True)
class TorchtuneBuilder:
    """One family of torchtune model builders: the configs it builds (``model_type``, the RoPE kind
    and the builders' ``max_seq_len``, which is each checkpoint's ``max_position_embeddings``), the
    release it came in, and from which release its full and its LoRA builders make one RoPE module
    that every layer shares (None: each layer keeps its own, every release). ``factor``: cache
    positions per ``max_seq_len`` position in trainmem's [N, head_dim/2, 2] layout (Qwen2's and
    Phi-3's modules keep cos and sin over the whole head_dim, [max_seq_len, 2 x head_dim])."""

    name: str
    model_type: str
    rope: str                     # "10000": no scaling, rope_theta 1e4 (or unset); "500000", "1000000"; "llama3": rope_type llama3
    max_seq_len: tuple[int, ...]
    since: str
    shared_full: str | None
    shared_lora: str | None
    factor: int = 1
    llama3_factor: float | None = None   # the llama3 rope_scaling factor that tells Llama 3.2 (32) from 3.1/3.3 (8)


#: torchtune's builders (``torchtune/models/*/_model_builders.py`` max_seq_len, at each tag). Full
#: builders up to v0.5.0 build one decoder layer with its ``rope`` and hand it to ``TransformerDecoder``
#: with ``num_layers``, which deep-copies it (``_get_clones``, torchtune/modules/transformer.py L307,
#: L379 at v0.5.0; e.g. llama2/_component_builders.py L85, L116): one cache per layer. From v0.6.0 they
#: build the layers in a loop around one ``rope`` (llama2 L88-92, llama3 L88-93, mistral L81-85, qwen2
#: L84-87, gemma L78-81, phi3 L72-74 at v0.6.1). The LoRA builders make the RoPE module inside
#: ``lora_*_self_attention``, once per layer, in every release (llama2 L417, llama3 L418, mistral L399,
#: qwen2 L393, gemma L345, gemma2 L392, phi3 L377 at v0.6.1). Llama 3.1 / 3.2 (and 3.3, built by the
#: 3.1 builders) share one ``Llama3ScaledRoPE`` in both from v0.3.1 (llama3_1 L85-88 and L208-211,
#: llama3_2 L87-89 and L209-211 at v0.3.1; per layer at v0.3.0: llama3_1 L87, L113 and L387); Gemma-2's
#: full builder shares one from its first release (gemma2 L115-117 at v0.5.0 and v0.6.1).
TORCHTUNE_BUILDERS = (
    TorchtuneBuilder("llama2", "llama", "10000", (4096,), "0.1.0", "0.6.0", None),
    TorchtuneBuilder("code_llama2", "llama", "1000000", (16384,), "0.2.0", "0.6.0", None),
    TorchtuneBuilder("llama3", "llama", "500000", (8192,), "0.1.1", "0.6.0", None),
    TorchtuneBuilder("llama3_1", "llama", "llama3", (131072,), "0.2.1", "0.3.1", "0.3.1", llama3_factor=8.0),
    TorchtuneBuilder("llama3_2", "llama", "llama3", (131072,), "0.3.1", "0.3.1", "0.3.1", llama3_factor=32.0),
    TorchtuneBuilder("mistral", "mistral", "10000", (32768,), "0.1.0", "0.6.0", None),
    TorchtuneBuilder("qwen2", "qwen2", "1000000", (32768,), "0.3.0", "0.6.0", None, factor=2),
    TorchtuneBuilder("qwen2_5", "qwen2", "1000000", (32768, 131072), "0.4.0", "0.6.0", None, factor=2),
    TorchtuneBuilder("gemma", "gemma", "10000", (8192,), "0.1.0", "0.6.0", None),
    TorchtuneBuilder("gemma2", "gemma2", "10000", (8192,), "0.5.0", "0.5.0", None),
    TorchtuneBuilder("phi3", "phi3", "10000", (4096,), "0.2.0", "0.6.0", None, factor=2),
)


def _release(version: tuple[int, ...] | None) -> tuple[int, ...]:
    """``--framework-version`` as major.minor.patch (``0.4`` is 0.4.0); None: the preset's release."""
    v = version or _v(REPOS["torchtune"][1].lstrip("v"))
    return tuple(v[:3]) + (0,) * (3 - len(v[:3]))


def _rope_kind(config: Mapping[str, Any]) -> tuple[str, float | None]:
    """The config's RoPE as ``TorchtuneBuilder.rope`` names it, and its llama3 scaling factor."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if isinstance(scaling, Mapping) and (scaling.get("rope_type") or scaling.get("type")) == "llama3":
        return "llama3", scaling.get("factor")
    theta = config.get("rope_theta") or (scaling.get("rope_theta") if isinstance(scaling, Mapping) else None)
    return str(int(theta or 10000)), None


def torchtune_builder(model: Any, version: tuple[int, ...] | None) -> TorchtuneBuilder | None:
    """The torchtune builder family that builds ``model`` at ``version`` (None: the current release),
    matched on its config's model_type, RoPE and ``max_position_embeddings``; None when no builder of
    that release builds it."""
    if model is None or getattr(model, "head", "") != "causal-lm" or getattr(model, "is_encoder_decoder", False):
        return None
    rope, factor = _rope_kind(getattr(model, "config", None) or {})
    at = _release(version)
    for b in TORCHTUNE_BUILDERS:
        if (b.model_type == model.model_type and b.rope == rope and model.max_positions in b.max_seq_len
                and (b.llama3_factor is None or b.llama3_factor == factor) and _v(b.since) <= at):
            return b
    return None


def torchtune_rope(model: Any, version: tuple[int, ...] | None, lora: bool) -> tuple[str, int] | None:
    """``("rope_cache", N)`` when torchtune's builder for ``model`` at ``version`` makes one RoPE module
    the layers share, ``("layer_rope_cache", N)`` when each layer keeps its own (``TORCHTUNE_BUILDERS``),
    N the cache's positions in trainmem's layout; None without a builder."""
    b = torchtune_builder(model, version)
    if b is None:
        return None
    at = _release(version)
    since = b.shared_lora if lora else b.shared_full
    shared = since is not None and _v(since) <= at
    return ("rope_cache" if shared else "layer_rope_cache"), model.max_positions * b.factor


def caps_hidden_not_logits(m: Any, t: Any) -> bool:
    """Whether the run soft-caps the final hidden state where transformers caps the logits: torchtune's
    Gemma-2 (every release with it, v0.5.0 on) ends its decoder with ``Gemma2FinalNorm``, which
    applies the ``final_capping_value`` soft-cap (``TanhSoftCapping``: ``x / cap``, ``torch.tanh``,
    ``* cap``) to the normed (b, s, hidden) state before the output projection, not to its output
    (torchtune/models/gemma2/_component_builders.py L37-69 and L160 at v0.6.1); transformers'
    ``Gemma2ForCausalLM`` caps the logits (``softcap_saved``). Read off torchtune 0.6.1's own
    ``gemma2`` traced on the emulated GPU (docs/validation.md, 2026-11-25)."""
    return (t.extra.get("framework") == "torchtune" and getattr(m, "head", "") == "causal-lm"
            and getattr(m, "model_type", "") == "gemma2"
            and bool(getattr(m, "config", None) and m.config.get("final_logit_softcapping") is not None))


def torchtune_offload_exempts_parameters(t: Any) -> bool:
    """Whether torchtune's ``OffloadActivations`` keeps saved ``nn.Parameter``s (and buffers) on the GPU
    instead of offloading them: from 3ca0d309c (2024-10-18, "Add offloading tests and fix obscure edge
    case", torchtune v0.4.0; _activation_offloading.py ``pack_tensor``); before it every saved tensor of
    at least ``min_offload_size`` bytes was offloaded (L134-197 at 30b8519e8, the check at L150). No ``--framework-version``:
    the preset's release (0.6.1), which exempts them."""
    version = t.extra.get("framework_version")
    return version is None or _v(str(version).strip().lstrip("v"))[:2] >= (0, 4)


def torchtune_builds_template_on_device(t: Any) -> bool:
    """Whether torchtune builds the run's model on the GPU from one template layer that it then
    deep-copies ``num_layers`` times, the template freed when the builder returns and its blocks left
    in the caching allocator (``estimate.quant4.torchtune_v01_build`` replays the build). The
    single-device recipes build on the device in the recipe's dtype
    (``recipes/lora_finetune_single_device.py`` L254-255 at ff594c231, v0.1.0: ``with
    utils.set_default_dtype(self._dtype), self._device: model = config.instantiate(cfg_model)``;
    ``full_finetune_single_device.py`` the same); the distributed ones build elsewhere (meta device or
    CPU) and shard. Up to 0.5 the builders hand one layer to ``TransformerDecoder``, whose
    ``_get_clones`` deep-copies it (``torchtune/modules/transformer.py`` L93, L137 at ff594c231;
    ``torchtune/models/llama2/_component_builders.py`` L113-114, L242-243 from v0.1.0 to v0.5.0); from
    0.6.0 they build a list of layers in a loop. A deep-copied template is what gives each layer its
    own RoPE cache there (``--layer-rope-cache``, ``TORCHTUNE_BUILDERS``), so that option before 0.6
    marks it. bf16 (the builder's tensors are replayed at 2 B per element), one GPU, no
    ``--quantize`` (torchao 0.1's NF4 build is ``quant4.builds_on_device``'s own case)."""
    if t.extra.get("framework") != "torchtune" or t.layer_rope_cache is None or t.precision != "bf16":
        return False
    version = t.extra.get("framework_version")
    if version is None or _v(str(version).strip().lstrip("v"))[:2] >= (0, 6):
        return False
    return (not t.quantize and t.dp == 1 and t.tp == 1 and t.pp == 1 and t.cp == 1 and t.fsdp is None
            and not t.zero_stage)


def torchtune_loop_shifts_fp32_logits(t: Any) -> bool:
    """Whether the loop is torchtune's before 0.3, which computes the loss on a shifted copy of the
    decoder's fp32 output: ``logits = self._model(input_ids)`` (``TransformerDecoder`` returns
    ``self.output(h).float()``, torchtune/modules/transformer.py L210 at ff594c231), then ``logits =
    logits[..., :-1, :].contiguous()``, ``logits = logits.transpose(1, 2)`` and
    ``self._loss_fn(logits, labels)`` with ``nn.CrossEntropyLoss``
    (recipes/lora_finetune_single_device.py L447-453 at ff594c231; full_finetune_single_device.py
    L416-426 at 0217d44c2), the shifted copy held in ``logits`` until the next forward returns. What the
    preset sets for those releases (loss upcast, one chunk, ``--cast-output``, ``--hold-output
    step``); from 0.3 the chunked loss and ``del logits`` (the preset's ``Since`` entries)."""
    if t.extra.get("framework") != "torchtune":
        return False
    version = t.extra.get("framework_version")
    if version is None or _v(str(version).strip().lstrip("v"))[:2] >= (0, 3):
        return False
    return t.cast_output and t.loss == "upcast" and t.loss_chunks <= 1 and t.hold_output == "step"


def torchtune_norm_saves_fp32(m: Any, t: Any) -> bool:
    """Whether the run's RMSNorm saves its fp32 normalized product for the weight's gradient:
    torchtune 0.5.0 to 0.6.1's ``RMSNorm.forward`` is ``F.rms_norm(x.float(), normalized_shape,
    weight=self.scale, eps=self.eps).to(x.dtype)`` (``torchtune/modules/rms_norm.py`` L38-43 at
    v0.6.1; from 1450d6126 of 2024-11-25, after v0.4.0; main went back to the Python ops in
    c5c160b42 of 2025-03-26, after the 0.6 branch). PyTorch's composite ``rms_norm`` multiplies the
    fp32 normalized tensor by the bf16 weight, an fp32 product that ``MulBackward0`` saves for the
    weight's gradient (4 B per element), where the Python ops (transformers' ``LlamaRMSNorm``,
    torchtune up to 0.4) save its cast to the input's dtype (2 B). Traced with torchtune 0.6.1's own
    ``qwen2`` layer, 1,792 B more per token and norm at hidden 896 (docs/validation.md, 2026-11-25).
    The hand-written families torchtune builds with that module (Llama, Mistral, Qwen2); its
    Gemma models have their own norm. ``--framework-version`` older than 0.5: the Python ops."""
    if t.extra.get("framework") != "torchtune" or getattr(m, "family", "") != "llama":
        return False
    version = t.extra.get("framework_version")
    return version is None or _v(str(version).strip().lstrip("v"))[:2] >= (0, 5)


def _repeats_kv(view: Mapping[str, Any], model: Any) -> bool:
    """Whether torchtune's attention copies K and V to the query's heads here. Every release's
    ``MultiHeadAttention.forward`` does when ``num_heads != num_kv_heads``: ``k.unsqueeze(2).expand(
    expand_shape).flatten(1, 2)`` (and v) before ``_attention_call`` (torchtune/modules/attention.py
    L288-291 at v0.6.1; ``k.expand(...)`` then a reshape at v0.1.0 L183-184, v0.4.0 L283-284), and
    SDPA saves the copies: per token and layer 2 x (heads - kv_heads) x head_dim more half values
    than transformers' call, which passes ``enable_gqa`` or repeats nothing. Qwen2, Mistral and the
    Llama 3 builders use that module (torchtune/models/qwen2/_component_builders.py L88-106,
    mistral/_component_builders.py L86 at v0.6.1). Hand-written families only: a derived
    architecture's layers come from transformers' own traced code (give ``--attention-call
    repeat-kv`` to count the copies there), and the emulation calls SDPA on one GPU or data
    parallelism (``TrainingSpec._check_attention_call``)."""
    if model is None or getattr(model, "family", "derived") == "derived" or getattr(model, "head", "") != "causal-lm":
        return False
    if model.num_kv_heads == model.num_heads:
        return False
    single = view.get("tp", 1) == 1 and view.get("pp", 1) == 1 and view.get("cp", 1) == 1
    return single and view.get("attention", "sdpa") in SDPA_ATTENTION


def _others(t: Any, framework: str, zero: bool = True, dist: bool = True) -> list[str]:
    """The sharding a framework does not use: DeepSpeed's ZeRO, Megatron's distributed optimizer."""
    out = []
    if zero and t.zero and t.fsdp is None:
        out.append(f"--zero {t.zero} is DeepSpeed's ZeRO: {framework} does not run it")
    if dist and t.distributed_optimizer:
        out.append(f"--distributed-optimizer is Megatron's (or NeMo's): {framework} does not run it")
    if t.recompute == "op" and framework != "torchtitan":
        out.append(f"--recompute op is torchtitan's per-op checkpointing policy: {framework} does not run it")
    if t.offload_activations and framework != "torchtune":
        out.append(f"--offload-activations is torchtune's OffloadActivations: {framework} does not run it")
    return out


def _no_dtype(t: Any, model: Any, given: frozenset[str]) -> list[str]:
    """transformers >= 5 loads the weights' own dtype when the config names none: unknown here."""
    if "precision" in given or _dtype_precision(model) is not None:
        return []
    return [f"the model config names no dtype (transformers 5 loads the checkpoint's own): --precision stays "
            f"{t.precision}; give --precision to say how the weights are loaded"]


def _check_nanogpt(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    bad = [f"--{k} {getattr(t, k)}" for k in ("tp", "pp", "cp") if getattr(t, k) > 1]
    if t.zero_stage:
        bad.append(f"--fsdp {t.fsdp}" if t.fsdp else f"--zero {t.zero}")
    if t.distributed_optimizer:
        bad.append("--distributed-optimizer")
    if t.lora_rank:
        bad.append("--lora-rank")
    if not bad:
        return []
    return [f"{', '.join(bad)}: nanoGPT's train.py runs one GPU or DDP (--dp) with full fine-tuning only"]


def _check_hf(t: Any, model: Any, version: tuple[int, ...] | None, given: frozenset[str]) -> list[str]:
    out = _others(t, "the HF Trainer", zero=False)
    if t.quantize and "precision" in given and t.precision in ("bf16", "fp16") and t.quantize_via == "transformers":
        out.append(f"--precision {t.precision} with --quantize: peft's prepare_model_for_kbit_training (which TRL's "
                   f"SFTTrainer runs) casts the weights that are not 4-bit to fp32 and bf16=True autocasts: that run is "
                   f"--precision {t.precision}-amp")
    if version is None or version >= (5,):
        out += _no_dtype(t, model, given)
    if version is not None and version < (4, 49) and "loss" not in given and getattr(model, "head", "") == "causal-lm" \
            and t.transformers_version is None:
        # a model without a release table (spec.tf_releases): the preset does not imply --transformers-version
        out.append(f"transformers {'.'.join(map(str, version))}: {getattr(model, 'name', 'the model')}'s loss of that "
                   f"release may also copy the shifted logits (removed in 4.49), which trainmem does not count: "
                   f"its release table covers llama, mistral, qwen2, mixtral, gpt2, bert and opt")
    return out


def _check_trl(t: Any, model: Any, version: tuple[int, ...] | None, given: frozenset[str]) -> list[str]:
    out = _others(t, "TRL's SFTTrainer", zero=False)
    if t.trainer == "dpo":  # DPOTrainer: no chunked_nll, its metrics counted (estimate/preference.py)
        return out
    lm = getattr(model, "head", "") == "causal-lm"
    if lm and "loss" not in given and t.loss is None and (version is None or version >= (1, 7)):
        why = chunked_nll_problem(model, bool(t.quantize) and t.quantize_via == "fabric")
        out.append(f"TRL >= 1.7 computes loss_type='chunked_nll' (the head and cross-entropy over 256-token chunks "
                   f"of the labelled tokens, each recomputed in backward: no whole logits tensor), which the estimate "
                   f"does not model here ({why}): the preset counts the model's own loss over the whole logits "
                   f"(loss_type='nll'), an upper bound; trainmem trace --loss chunked-nll runs TRL's")
    metrics = _trl_metrics(t, model, version, given) if lm else None
    if metrics:
        out.append(metrics)
    if t.quantize and t.lora_rank and version is not None and version < (0, 22) and t.precision == "bf16-amp" \
            and t.quantize_via == "transformers" and not t.half_embeddings:
        out.append("TRL < 0.22 with bf16: peft_module_casting_to_bf16 casts the embeddings and head back to bf16 after "
                   "prepare_model_for_kbit_training; without --half-embeddings trainmem counts them fp32 (2 bytes "
                   "per parameter more)")
    return out


def trl_metric_bytes(batch: int, seq: int, vocab: int, elem: int, version: tuple[int, ...] | None) -> int:
    """The most bytes SFTTrainer's metrics hold at once after a loss_type='nll' loss: the held
    (b, s, vocab) logits, a contiguous copy of the shifted (b, s - 1, vocab) logits when b > 1
    (``.contiguous()`` in the accuracy code, or ``entropy_from_logits``' reshape of the shifted view
    in 1.x; one sequence's slice is contiguous already) and, from 0.22, one entropy chunk's
    log_softmax, exp and product (rows x vocab each: one sequence in 0.22, 128 rows from 0.23),
    ``elem`` bytes per logit."""
    held = batch * seq * vocab * elem
    shifted = batch * (seq - 1) * vocab * elem if batch > 1 else 0   # one sequence's shifted slice is contiguous
    rows = 128 if version is None or version >= (0, 23) else seq
    chunk = 3 * min(rows, batch * (seq - 1)) * vocab * elem if version is None or version >= (0, 22) else 0
    return held + shifted + chunk


def _trl_metrics(t: Any, model: Any, version: tuple[int, ...] | None, given: frozenset[str]) -> str | None:
    """With the model's own loss (loss_type 'nll': TRL 0.15 to 1.6, or asked for later), SFTTrainer's
    ``compute_loss`` keeps the outputs after the loss and computes, under no_grad, the token accuracy
    from ``outputs.logits[..., :-1, :].contiguous()`` (0.15 on: a copy of the shifted logits) and,
    from 0.22, the entropy with ``entropy_from_logits`` (log_softmax, exp and their product, one
    sequence at a time in 0.22, 128 rows at a time from 0.23; trl/trainer/utils.py L526-560 at v1.9.0).
    Under bf16/fp16 autocast the logits it reads are fp32: accelerate wraps the model's forward in
    ``convert_outputs_to_fp32`` (accelerate src/accelerate/accelerator.py ``prepare_model``). trainmem
    frees the output after the loss (``--hold-output loss``) and counts none of these; the line says
    how large they are."""
    nll = (version is not None and (0, 15) <= version < (1, 7)) or ("loss" in given and t.loss in (None, "upcast"))
    if not nll or t.loss in ("fused", "chunked", "chunked-nll", "half") or t.loss_chunks > 1:
        return None
    elem = 4 if t.precision.endswith("-amp") or t.precision == "fp32" else 2   # bytes per logit it reads
    entropy = version is None or version >= (0, 22)
    gib = trl_metric_bytes(t.batch_size, t.seq_len, model.vocab_size, elem, version) / 2**30
    return (f"TRL's compute_loss keeps the {'fp32 ' if elem == 4 else ''}logits after the loss for its token "
            f"accuracy{' and entropy' if entropy else ''} metrics (a shifted contiguous copy"
            f"{', log_softmax/exp chunks' if entropy else ''}), under no_grad, before backward: up to "
            f"{gib:.2f} GiB at that moment that trainmem does not count")


def _check_accelerate(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    return _others(t, "Accelerate", zero=False) + _no_dtype(t, model, given)


def _check_fsdp_only(name: str) -> Callable[..., list[str]]:
    """torchtune and torchtitan shard with FSDP2 only."""
    def check(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
        return _others(t, name)
    return check


def _check_torchtune(t: Any, model: Any, version: tuple[int, ...] | None, given: frozenset[str]) -> list[str]:
    """FSDP2 only (``_check_fsdp_only``), and one line where the builder's RoPE cache is not counted:
    a derived architecture (Gemma, Gemma-2, Phi-3: trainmem counts transformers' buffers) or a
    hand-written one no torchtune builder of that release makes (``torchtune_builder``)."""
    out = _others(t, "torchtune")
    if t.rope_cache is not None or t.layer_rope_cache is not None or model is None \
            or getattr(model, "head", "") != "causal-lm" or getattr(model, "is_encoder_decoder", False):
        return out
    at = "" if version is None else f" {'.'.join(map(str, version))}"
    found = torchtune_rope(model, version, bool(t.lora_rank))
    if found is None and model.family == "llama":
        out.append(f"no torchtune{at} builder makes {model.name} (model_type {model.model_type}, "
                   f"max_position_embeddings {model.max_positions}): its RoPE cache is not counted; give "
                   f"--rope-cache N (one module shared) or --layer-rope-cache N (one per layer)")
    elif found is not None and model.family == "derived":
        layers = 1 if found[0] == "rope_cache" else model.num_layers
        mib = layers * found[1] * model.head_dim * 4 / 2**20   # fp32 [N, head_dim/2, 2] per module
        out.append(f"torchtune{at}'s {torchtune_builder(model, version).name} builder keeps "
                   f"{'one fp32 RoPE cache' if layers == 1 else f'an fp32 RoPE cache in each of {layers} layers'} "
                   f"({mib:.0f} MiB) that trainmem does not count for a derived architecture")
    return out


def _check_lightning(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    return _others(t, "Lightning", zero=False)


def _check_litgpt(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    out = _others(t, "litgpt")
    if t.quantize and t.precision.endswith("-amp"):
        out.append(f"--quantize with --precision {t.precision}: litgpt refuses quantization with a mixed precision "
                   f"(finetune/lora.py L142-143); give --precision bf16-true")
    if t.quantize and t.dp > 1:
        out.append("--quantize with --dp > 1: litgpt quantizes on one device only (finetune/lora.py L153-157)")
    if getattr(model, "tied_embeddings", False):
        out.append("litgpt's GPT has no weight tying (model.py L28-31: lm_head and wte apart): trainmem counts this "
                   "model's tied head once; give --set tie_word_embeddings=false")
    return out


def _check_deepspeed(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    out = _others(t, "DeepSpeed", zero=False)
    if t.fsdp is not None:
        out.append(f"--fsdp {t.fsdp} is PyTorch FSDP: DeepSpeed shards with --zero 1|2|3")
    return out


def _check_megatron(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    return _others(t, "Megatron-LM", dist=False)


def _unsloth_rules(view: Mapping[str, Any], model: Any, version: tuple[int, ...] | None) -> dict[str, Any]:
    """Unsloth's layers and checkpointing follow the setup: ``patch_peft_model`` keeps peft's modules
    unless every projection has an adapter and there is no dropout (``_unsloth_patches``), and a
    ``--recompute`` other than ``full`` (``use_gradient_checkpointing=False``) turns the checkpointing
    off. (``from_pretrained(max_seq_length < 512)`` keeps torch's checkpoint, ``apply_unsloth_gradient_
    checkpointing``, unsloth ``models/_utils.py`` L208-214: that is the model's maximum, not the batch's
    length, so the preset leaves it to ``--no-unsloth-gc``.)"""
    out: dict[str, Any] = {}
    if not _unsloth_patches(view) or unsloth_biased(model):
        out["unsloth_kernels"] = False
    if view.get("recompute") != "full" or view.get("recompute_every", 1) > 1:
        return {**out, "unsloth_gc": False, "reentrant": None}
    return out


#: the projections ``patch_peft_model`` needs adapters on to run its LoRA Functions (its default targets)
UNSLOTH_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def _unsloth_patches(view: Mapping[str, Any]) -> bool:
    """Whether ``FastLlamaModel.patch_peft_model`` swaps in its LoRA Functions (unsloth 2026.3.5
    ``models/llama.py`` L3334-3420): ``lora_dropout == 0`` and ``bias == "none"``, adapters on every
    projection of the attention and of the MLP (trainmem models all seven or none)."""
    return bool(view.get("lora_rank")) and not view.get("lora_dropout") and \
        UNSLOTH_TARGETS <= set(view.get("lora_targets") or ())


#: Unsloth's patch (unsloth 2026.3.5 ``models/llama.py`` ``FastLlamaModel``) covers these transformers model
#: types with its Llama layer code (``LlamaDecoderLayer_fast_forward``); trainmem's ``llama`` family
UNSLOTH_TYPES = ("llama", "mistral", "qwen2")


def unsloth_biased(model: Any) -> tuple[str, ...]:
    """The projections of a layer with a bias (Qwen2's q/k/v): ``patch_peft_model`` leaves a bias-carrying
    group with peft's modules (unsloth 2026.3.5 ``models/llama.py`` L3350-3352, L3391-3393, L3413), so the layer
    is only partly patched, which trainmem does not model."""
    if model is None or not hasattr(model, "parameter_tensors"):
        return ()
    return tuple(sorted({p.module for p in model.parameter_tensors()
                         if p.layer == 0 and p.role == "bias" and p.module in UNSLOTH_TARGETS}))


def _check_unsloth(t: Any, model: Any, version: Any, given: frozenset[str]) -> list[str]:
    """What of Unsloth's step the estimate does not count as Unsloth runs it, one line each."""
    out = _others(t, "Unsloth")
    mtype = getattr(model, "config", {}).get("model_type") if isinstance(getattr(model, "config", None), dict) \
        else None
    if getattr(model, "family", "") != "llama" or (mtype is not None and mtype not in UNSLOTH_TYPES):
        out.append(f"{getattr(model, 'name', 'the model')}: the preset's options are Unsloth's FastLanguageModel "
                   f"defaults, read off its Llama code (llama, mistral, qwen2); this model's Unsloth code may differ")
    biased = unsloth_biased(model)
    if t.lora_rank and not t.unsloth_kernels and biased:
        out.append(f"{', '.join(biased)} carry a bias, so Unsloth's patch_peft_model leaves them (and the other "
                   f"projections of their group) to peft while it patches the rest: a partly patched layer is not "
                   f"modelled, peft's modules are counted for all (an upper bound)")
    elif t.lora_rank and not t.unsloth_kernels:
        out.append("Unsloth swaps in its LoRA_QKV, LoRA_W and LoRA_MLP Functions only with adapters on all of "
                   "q/k/v/o/gate/up/down_proj and no dropout (patch_peft_model); with these adapters the layers "
                   "are counted as transformers' modules with peft's (a partly patched layer is not modelled)")
    if not t.lora_rank:
        out.append("full fine-tuning (no --lora-rank): Unsloth's full_finetuning path (FastModel, unsloth_zoo's "
                   "compiled modules) is not modelled; the preset's options describe its QLoRA defaults")
    return out


def _s(repo: str, path: str, lines: str) -> Source:
    return Source(repo, path, lines)


_TF = "src/transformers/"
_NOT_SET = "user's code (trainmem default)"

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("plain", "a plain PyTorch loop", "torch 2.13.0", {
        "precision": Cell(shown="bf16-amp (trainmem default)",
                          note="PyTorch has no precision policy of its own: the loop trainmem writes runs "
                               "torch.autocast(bf16) over fp32 weights"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell(shown="foreach", sources=(_s("torch", "torch/optim/adam.py", "937-939"),),
                               note="torch.optim.AdamW picks foreach on CUDA when neither foreach nor fused is given"),
        "zero_grad": Cell(shown="none", sources=(_s("torch", "torch/optim/optimizer.py", "1024"),),
                          note="Optimizer.zero_grad(set_to_none=True) by default since PyTorch 2.0"),
        "hold_output": Cell(shown=_NOT_SET), "loss": Cell(shown="the model's own"),
        "attention": Cell(shown="sdpa (trainmem default)"), "recompute": Cell(shown="none"),
        "sharding": Cell(shown="none"), "dropout": Cell(shown="the config's"),
        "grad_sync": Cell(shown="micro-batch (trainmem default)"),
    }, torch_derived=("zero_grad",)),
    Preset("hf-trainer", "Hugging Face Trainer", "transformers 5.23.0", {
        "precision": Cell(shown="the checkpoint's dtype (v5), fp32 (v4)",
                          sources=(_s("transformers", _TF + "training_args.py", "874-885"),
                                   _s("transformers", _TF + "modeling_utils.py", "4177-4178"),
                                   _s("transformers-4.54", _TF + "modeling_utils.py", "4430-4436")),
                          note="bf16=False and fp16=False: no autocast; from_pretrained(dtype='auto') loads a bf16 "
                               "checkpoint (llama-3.2-1b) in bf16, so it trains in pure bf16 (no master copy); "
                               "transformers 4 loaded fp32. TrainingArguments(bf16=True) on fp32 weights is "
                               "--precision bf16-amp"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell("fused", (_s("transformers", _TF + "training_args.py", "806-811"),),
                               note="optim='adamw_torch_fused' with torch >= 2.8"),
        "zero_grad": Cell("none", (_s("transformers", _TF + "trainer.py", "1946"),
                                   _s("torch", "torch/nn/modules/module.py", "2948")),
                          note="model.zero_grad() after the step: set_to_none=True since PyTorch 2.0 "
                               "(the same call in every release from 4.31.0 on)"),
        "hold_output": Cell("loss", (_s("transformers", _TF + "trainer.py", "2164-2209"),
                                     _s("transformers", _TF + "trainer.py", "2120")),
                            note="compute_loss drops the outputs; training_step returns loss.detach()"),
        "loss": Cell(shown="the model's own (upcast)",
                     sources=(_s("transformers", _TF + "loss/loss_utils.py", "51-73"),),
                     note="ForCausalLMLoss: logits.float(), labels padded (no shifted copy since 4.49)"),
        "attention": Cell("sdpa", (_s("transformers", _TF + "modeling_utils.py", "1846"),)),
        "recompute": Cell("none", (_s("transformers", _TF + "training_args.py", "1544-1545"),),
                          note="activation_checkpointing (gradient_checkpointing) False"),
        "sharding": Cell(shown="none (DDP); --fsdp or --zero as configured"),
        "grad_sync": Cell("step", (_s("transformers", _TF + "trainer.py", "1896-1908"),),
                          note="every micro-batch but the last runs inside accelerator.no_sync (FSDP: the "
                               "gradients accumulate unsharded), unless sync_each_batch or DeepSpeed"),
        "dropout": Cell(shown="the config's"),
    }, since=(
        Since("optimizer_impl", "4.31", "for-loop", _s("transformers-4.31", _TF + "training_args.py", "1026")),
        Since("optimizer_impl", "4.32", "foreach", _s("transformers-4.32", _TF + "training_args.py", "1050")),
        Since("optimizer_impl", "4.54", "fused", _s("transformers-4.54", _TF + "training_args.py", "1286-1291")),
        Since("precision", "4.31", "fp32", _s("transformers-4.54", _TF + "modeling_utils.py", "4430-4436")),
        Since("precision", "5.0", None, _s("transformers-5.0", _TF + "modeling_utils.py", "3934-3935")),
    ), oldest="4.31", rules=_hf_rules, check=_check_hf, torch_derived=("zero_grad", "attention", "optimizer_impl"),
        notes=(
        "optim='adamw_hf' (before 4.32) is transformers' own AdamW, a loop over the parameters with one "
        "temporary per tensor (optimization.py:468 in 4.31.0); trainmem counts it as for-loop (two)",
        "use_liger_kernel=True (off by default) is --liger: the Trainer patches the model instance with "
        "_apply_liger_kernel_to_instance (trainer.py:1494-1495, integrations/liger.py:28-51, liger-kernel >= 0.3.0), "
        "whose defaults are apply_liger_kernel_to_llama's: RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy "
        "(--loss fused); liger_kernel_config={'fused_linear_cross_entropy': False} keeps the model's loss "
        "(--loss upcast)",
        "--framework-version X sets --transformers-version X (the Trainer is transformers) for the families of "
        "spec/tf_releases.py: before 4.49 the loss copied the shifted logits (4.45.2 modeling_llama.py:1214-1221, "
        "4.48.0 loss/loss_utils.py:32-47), before each family's SDPA support attention was eager; other models "
        "keep the installed code with a warning",
    )),
    Preset("trl", "TRL SFTTrainer (a Hugging Face Trainer subclass)", "trl 1.9.0", {
        "precision": Cell("bf16-amp", (_s("trl", "trl/trainer/base_config.py", "67-74"),
                                       _s("trl", "trl/trainer/base_config.py", "105"),
                                       _s("trl", "trl/trainer/utils.py", "1144")),
                          note="bf16=None becomes True unless fp16 is set (from 0.19; before, TrainingArguments' "
                               "False: fp32); a model given by name is loaded in float32 (model_init_kwargs' dtype "
                               "defaults to 'float32' from 0.27; transformers 4 loaded fp32 anyway): fp32 weights "
                               "under bf16 autocast. A model you load in bf16 and pass in trains in bf16: "
                               "--precision bf16"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell("fused", (_s("transformers", _TF + "training_args.py", "806-811"),
                                         _s("trl-0.21", "setup.cfg", "32")),
                               note="the Trainer's optim default: adamw_torch_fused from transformers 4.54, which "
                                    "TRL requires from 0.21 (transformers>=4.55.0); 0.12-0.20 ran with older "
                                    "transformers: foreach"),
        "zero_grad": Cell("none", (_s("transformers", _TF + "trainer.py", "1946"),),
                          note="the HF Trainer's model.zero_grad() (set_to_none=True)"),
        "hold_output": Cell("loss", (_s("trl", "trl/trainer/sft_trainer.py", "1700-1832"),),
                            note="compute_loss keeps the outputs after the loss for its token-accuracy and entropy "
                                 "metrics, under no_grad, and returns the loss: they are freed before backward. "
                                 "With loss_type='nll' (0.15 to 1.6) the metrics read the logits, fp32 under "
                                 "autocast (accelerate's convert_outputs_to_fp32), copy the shifted logits when "
                                 "the micro-batch has several sequences and run entropy_from_logits (utils.py "
                                 "L526-560) over 128 rows at a time: not counted, one warning line gives their "
                                 "size"),
        "loss": Cell(shown="the model's own (upcast) to 1.6; chunked-nll from 1.7 (a derived architecture: the "
                           "model's own, an upper bound, warned; trace --loss chunked-nll runs it)",
                     sources=(_s("trl", "trl/trainer/sft_config.py", "283-295"),
                              _s("trl", "trl/trainer/sft_config.py", "335-336"),
                              _s("trl", "trl/trainer/sft_trainer.py", "99-234")),
                     note="loss_type None is 'chunked_nll' from 1.7 unless use_liger_kernel: the patched forward "
                          "stops at the last hidden state, gathers the labelled tokens (hidden[order]) and runs the "
                          "head in fp32 and the cross-entropy on 256 of them at a time inside "
                          "torch.utils.checkpoint; 'dft' (0.23 on) multiplies the loss by the detached "
                          "probabilities; use_liger_kernel=True is Liger's patch: --liger (its RMSNorm, RoPE and "
                          "SwiGLU kernels and fused linear cross-entropy, --loss fused)"),
        "attention": Cell("sdpa", (_s("transformers", _TF + "modeling_utils.py", "1846"),),
                          note="padding_free (False by default; on with packing's 'bfd' strategy) flattens the "
                               "micro-batch into one sequence for flash attention: give --attention flash and "
                               "--batch-size 1 --seq-len <tokens of the micro-batch>"),
        "recompute": Cell("full", (_s("trl", "trl/trainer/base_config.py", "61-66"),),
                          note="gradient_checkpointing defaults to True from 0.22 (TRL's own config), with "
                               "use_reentrant=False under transformers 4 (sft_trainer.py L1332-1334)"),
        "sharding": Cell(shown="none (DDP); --fsdp or --zero as configured"),
        "grad_sync": Cell("step", (_s("transformers", _TF + "trainer.py", "1896-1908"),),
                          note="the HF Trainer's accelerator.no_sync while accumulating"),
        "dropout": Cell(shown="the config's"),
        "seq_len": Cell(1024, (_s("trl", "trl/trainer/sft_config.py", "205-212"),),
                        note="max_length (max_seq_length before 0.16; 0.12-0.14 took min(model_max_length, 1024)) "
                             "1024: samples are truncated to it and a micro-batch is padded to its longest sample, "
                             "so 1024 is the worst case and, with packing, the length of every block; "
                             "--seq-len gives the real one"),
    }, since=(
        Since("precision", "0.12", "fp32", _s("transformers", _TF + "training_args.py", "874-885")),
        Since("precision", "0.19", "bf16-amp", _s("trl-0.19", "trl/trainer/sft_config.py", "252")),
        Since("optimizer_impl", "0.12", "foreach", _s("trl-0.12", "setup.py", "82")),
        Since("optimizer_impl", "0.21", "fused", _s("trl-0.21", "setup.cfg", "32")),
        Since("recompute", "0.12", "none", _s("transformers", _TF + "training_args.py", "1544-1545")),
        Since("recompute", "0.22", "full", _s("trl-0.22", "trl/trainer/sft_config.py", "111-115")),
    ), oldest="0.12", rules=_trl_rules, check=_check_trl, torch_derived=("zero_grad", "attention", "optimizer_impl"),
        notes=(
        "the preset's seq_len is max_length's 1024 (sft_config.py:205-212), the longest a micro-batch can be",
        "QLoRA: the model's weights that are not 4-bit stay as loaded (float32 by default) under bf16 autocast "
        "(--precision bf16-amp); from 0.26 the adapters are cast to bf16 (sft_trainer.py:1127-1130, --lora-dtype "
        "half); 0.12-0.21 ran peft's prepare_model_for_kbit_training and peft_module_casting_to_bf16 "
        "(embeddings and head to bf16, norms fp32: --half-embeddings, which the preset sets with bf16)",
        "use_cache=False in compute_loss from 0.22 (sft_trainer.py:1710): no KV cache",
        "use_liger_kernel (False; --liger: Liger-Kernel's layer kernels and fused linear cross-entropy) and "
        "activation_offloading (False) are off by default; "
        "completion_only_loss and assistant_only_loss change which labels are -100, not a tensor's size",
    )),
    Preset("accelerate", "Hugging Face Accelerate", "accelerate 1.15.0", {
        "precision": Cell(shown="the checkpoint's dtype",
                          sources=(_s("accelerate", "src/accelerate/state.py", "926-927"),),
                          note="mixed_precision defaults to 'no' (no autocast): the weights train in the dtype "
                               "the model was loaded in (transformers 5: the checkpoint's)"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell(shown="foreach (the loop's torch.optim.AdamW)",
                               sources=(_s("accelerate-main", "examples/nlp_example.py", "140"),)),
        "zero_grad": Cell("none", (_s("accelerate", "src/accelerate/optimizer.py", "112-118"),)),
        "hold_output": Cell("step", (_s("accelerate-main", "examples/nlp_example.py", "163-170"),),
                            note="outputs = model(**batch) lives until the next batch's forward replaces it"),
        "loss": Cell(shown="the model's own"), "attention": Cell(shown="the model's (sdpa)"),
        "recompute": Cell(shown="none"), "sharding": Cell(shown="as configured"), "dropout": Cell(shown="the config's"),
        "grad_sync": Cell("step", (_s("accelerate", "src/accelerate/accelerator.py", "1133-1172"),
                                   _s("accelerate", "src/accelerate/accelerator.py", "1288-1292")),
                          note="accumulate() enters no_sync (FSDP1 model.no_sync, FSDP2 "
                               "set_requires_gradient_sync(False)) unless sync_each_batch=True"),
    }, rules=_accelerate_rules, check=_check_accelerate, torch_derived=("zero_grad",)),
    Preset("torchtune", "torchtune full_finetune_distributed", "torchtune 0.6.1", {
        "precision": Cell("bf16", (_s("torchtune", "recipes/configs/llama3_2/1B_full.yaml", "76"),
                                   _s("torchtune", "recipes/full_finetune_distributed.py", "539")),
                          note="the model is built in bf16 (training.set_default_dtype): pure bf16, no master copy"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell("fused", (_s("torchtune", "recipes/configs/llama3_2/1B_full.yaml", "55-58"),),
                               note="the single-device config uses bitsandbytes PagedAdamW8bit with "
                                    "optimizer_in_bwd: give --optimizer adamw-8bit --optimizer-in-backward"),
        "zero_grad": Cell("none", (_s("torchtune", "recipes/full_finetune_distributed.py", "839"),)),
        "hold_output": Cell("loss", (_s("torchtune", "recipes/full_finetune_distributed.py", "802-805"),),
                            note="del logits after the loss, before backward"),
        "loss": Cell("chunked", (_s("torchtune", "recipes/configs/llama3_2/1B_full.yaml", "59-60"),
                                 _s("torchtune", "torchtune/modules/loss/ce_chunked_output_loss.py", "30"))),
        "loss_chunks": Cell(8, (_s("torchtune", "torchtune/modules/loss/ce_chunked_output_loss.py", "30"),
                                _s("torchtune", "recipes/full_finetune_distributed.py", "348-349"))),
        "attention": Cell("sdpa", (_s("torchtune", "torchtune/modules/attention_utils.py", "185-259"),)),
        "recompute": Cell("none", (_s("torchtune", "recipes/configs/llama3_2/1B_full.yaml", "69"),),
                          note="enable_activation_offloading is off unless set; the recipes allow it only with "
                               "activation checkpointing (full_finetune_distributed.py L205-213): "
                               "--recompute full --offload-activations"),
        "sharding": Cell(shown="fsdp full with --dp > 1", option="fsdp",
                         sources=(_s("torchtune", "recipes/full_finetune_distributed.py", "590-596"),
                                  _s("torchtune", "recipes/full_finetune_distributed.py", "299"))),
        "dropout": Cell(shown="the config's"),
        "grad_sync": Cell(shown="micro-batch (trainmem default; the recipe calls no no_sync)"),
    }, since=(
        # up to 0.2: the configs' torch.nn.CrossEntropyLoss on the decoder's fp32 output
        # (``output = self.output(h).float()``), whose shifted contiguous copy the loop keeps until the next
        # forward (no ``del logits``); from 0.3 CEWithChunkedOutputLoss on 8 bf16 chunks, ``del logits``
        Since("loss", "0.1", "upcast", _s("torchtune-0.2", "recipes/configs/llama3/8B_full.yaml", "57")),
        Since("loss_chunks", "0.1", None, _s("torchtune-0.2", "recipes/configs/llama3/8B_full.yaml", "57")),
        Since("cast_output", "0.1", True, _s("torchtune-0.2", "torchtune/modules/transformer.py", "250")),
        Since("hold_output", "0.1", "step", _s("torchtune-0.2", "recipes/full_finetune_distributed.py", "519-529")),
        Since("loss", "0.3", "chunked", _s("torchtune-0.3", "recipes/configs/llama3_1/8B_full.yaml", "61")),
        Since("loss_chunks", "0.3", 8, _s("torchtune-0.3", "recipes/full_finetune_distributed.py", "231")),
        Since("cast_output", "0.3", None, _s("torchtune-0.3", "recipes/full_finetune_distributed.py", "231")),
        Since("hold_output", "0.3", "loss", _s("torchtune-0.3", "recipes/full_finetune_distributed.py", "642")),
        # the configs' torch.optim.AdamW names no implementation up to 0.3.0 (torch's default, foreach; the
        # Llama 3 8B full configs say foreach: False); fused: True in 71 of the 72 AdamW configs of 0.3.1
        Since("optimizer_impl", "0.1", None, _s("torchtune-0.2", "recipes/configs/llama2/7B_full.yaml", "52-53")),
        Since("optimizer_impl", "0.3.1", "fused", _s("torchtune-0.3.1", "recipes/configs/llama3_1/8B_full.yaml", "56-58")),
    ), oldest="0.1.0", rules=_torchtune_rules, check=_check_torchtune, min_torch="2.0"),
    Preset("torchtitan", "torchtitan", "torchtitan 0.2.2", {
        "precision": Cell(shown="bf16-mp with FSDP (--dp > 1), else bf16-amp (fp32 with TP/PP alone)",
                          sources=(_s("torchtitan", "torchtitan/config/job_config.py", "282-290"),
                                   _s("torchtitan", "torchtitan/models/llama3/infra/parallelize.py", "125-138"),
                                   _s("torchtitan", "torchtitan/distributed/utils.py", "243-263"))),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell("fused", (_s("torchtitan", "torchtitan/config/job_config.py", "135-151"),)),
        "zero_grad": Cell("none", (_s("torchtitan", "torchtitan/train.py", "550"),)),
        "hold_output": Cell("loss", (_s("torchtitan", "torchtitan/train.py", "532-542"),),
                            note="del pred before loss.backward()"),
        "loss": Cell("upcast", (_s("torchtitan", "torchtitan/components/loss.py", "20-27"),),
                     note="cross_entropy(pred.flatten(0, 1).float())"),
        "attention": Cell(shown="sdpa (not verified: cuDNN, flash, math pinned in that order)",
                          sources=(_s("torchtitan", "torchtitan/models/attention.py", "168-190"),),
                          note="trainmem's sdpa follows PyTorch's own order (cuDNN first only on sm90/sm100); "
                               "--attention sdpa-cudnn pins cuDNN alone"),
        "recompute": Cell("full", (_s("torchtitan", "torchtitan/config/job_config.py", "651-655"),
                                   _s("torchtitan", "torchtitan/distributed/activation_checkpoint.py", "39-40")),
                          note="mode 'selective', selective_ac_option '2': every 2nd layer fully recomputed; "
                               "train_configs/llama3_8b.toml L57-59 sets selective_ac_option 'op' (per-op SAC): "
                               "--recompute op. torchtitan main (SelectiveAC, June 2026) has only per-op SAC"),
        "recompute_every": Cell(2, (_s("torchtitan", "torchtitan/config/job_config.py", "655"),)),
        "sharding": Cell(shown="fsdp full with --dp > 1 (grad-op with --pp > 1); an untied model's embedding and "
                               "[norm, head] units: --fsdp-gathered head", option="fsdp",
                         sources=(_s("torchtitan", "torchtitan/config/job_config.py", "324"),
                                  _s("torchtitan", "torchtitan/models/llama3/infra/parallelize.py", "319-327"),
                                  _s("torchtitan", "torchtitan/models/llama3/infra/parallelize.py", "333-357"))),
        "dropout": Cell(shown="the config's"),
        "grad_sync": Cell(shown="micro-batch (trainmem default)"),
        "expandable_segments": Cell(True, (_s("torchtitan", "run_train.sh", "42"),),
                                    note="its launcher runs torchrun with PYTORCH_ALLOC_CONF=\"expandable_segments:True\" "
                                         "(run_train.sh L42 at v0.2.2; run_llama_train.sh from PR #643, 2024-10-22, on, "
                                         "run_train.sh in every release): --expandable-segments; a run before that date, "
                                         "or not started by the script, is --no-expandable-segments. Under --torch-version "
                                         "2.9 off: the script sets the new name PYTORCH_ALLOC_CONF (since e629fe58a, "
                                         "2025-08-15), which PyTorch 2.9's CUDA allocator does not read (pytorch/pytorch "
                                         "issue #183387)"),
    }, rules=_torchtitan_rules, check=_check_fsdp_only("torchtitan"), min_torch="2.0"),
    Preset("lightning", "PyTorch Lightning Trainer", "lightning 2.6.5", {
        "precision": Cell("fp32", (_s("lightning", "src/lightning/pytorch/trainer/connectors/accelerator_connector.py",
                                      "265"),),
                          note="precision='32-true'; 'bf16-mixed' is --precision bf16-amp, "
                               "'bf16-true' --precision bf16"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell(shown="foreach (configure_optimizers' torch.optim)"),
        "zero_grad": Cell("zeros", (_s("lightning", "src/lightning/pytorch/loops/optimization/automatic.py", "131-140"),
                                    _s("lightning", "src/lightning/pytorch/core/module.py", "1391")),
                          note="zero_grad() runs after training_step and before backward, so the last step's "
                               "gradients live through the forward; trainmem's zeros also keeps them at the start "
                               "of backward (an upper bound)"),
        "hold_output": Cell("loss", (_s("lightning", "src/lightning/pytorch/loops/optimization/automatic.py",
                                        "62-74"),),
                            note="training_step returns the loss; its locals (the logits) are freed"),
        "loss": Cell(shown=_NOT_SET, note="a Fabric loop (litgpt's finetune scripts) gets the model's output as "
                                          "an fp32 copy (_FabricModule.forward: precision.convert_output) and "
                                          "computes its loss on it: --loss half --cast-output"),
        "attention": Cell(shown="the model's (sdpa)"), "recompute": Cell(shown="none"),
        "sharding": Cell(shown="as the strategy says"), "dropout": Cell(shown="the config's"),
        "grad_sync": Cell(shown="micro-batch (trainmem default); a Fabric loop under no_backward_sync: step",
                          note="Fabric's no_backward_sync is FSDP's no_sync (lightning/fabric/strategies/fsdp.py "
                               "_FSDPBackwardSyncControl); litgpt's finetune scripts use it while accumulating"),
    }, rules=_lightning_rules, check=_check_lightning),
    Preset("litgpt", "LitGPT finetune scripts (Lightning Fabric)", "litgpt 0.5.13", {
        "precision": Cell("bf16-amp", (_s("litgpt", "litgpt/utils.py", "363-380"),
                                       _s("litgpt", "litgpt/finetune/lora.py", "131")),
                          note="get_default_supported_precision(training=True) is 'bf16-mixed' (fp32 weights, "
                               "autocast); the config_hub YAMLs set 'bf16-true': --precision bf16-true"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell(shown="foreach (torch.optim.AdamW by name)",
                               sources=(_s("litgpt", "litgpt/finetune/lora.py", "231"),
                                        _s("litgpt", "litgpt/utils.py", "636-653"))),
        "zero_grad": Cell("none", (_s("litgpt", "litgpt/finetune/lora.py", "365"),),
                          note="optimizer.zero_grad(): set_to_none"),
        "hold_output": Cell("step", (_s("litgpt", "litgpt/finetune/lora.py", "355"),),
                            note="logits = model(...) lives until the next forward replaces it"),
        "loss": Cell("half", (_s("litgpt", "litgpt/finetune/lora.py", "355-358"),
                              _s("litgpt", "litgpt/utils.py", "302-331")),
                     note="chunked_cross_entropy on Fabric's fp32 copy of the output (--cast-output)"),
        "loss_chunks": Cell(shown="ceil(seq / 128) with LoRA (lm_head_chunk_size=128)",
                            sources=(_s("litgpt", "litgpt/model.py", "177-179"),)),
        "attention": Cell("sdpa", (_s("litgpt", "litgpt/model.py", "593-595"),),
                          note="is_causal without a mask; grouped K/V repeated first (model.py L533-539)"),
        "recompute": Cell(shown="none; full with --dp > 1",
                          sources=(_s("litgpt", "litgpt/finetune/lora.py", "522-529"),
                                   _s("litgpt", "litgpt/finetune/full.py", "107-114"))),
        "sharding": Cell(shown="fsdp full with --dp > 1 (FSDP2 for LoRA, FSDP1 for full fine-tuning)", option="fsdp",
                         sources=(_s("litgpt", "litgpt/finetune/lora.py", "152-166"),
                                  _s("litgpt", "litgpt/finetune/full.py", "107-114"))),
        "dropout": Cell(False, (_s("litgpt", "litgpt/model.py", "594"),),
                        note="litgpt's GPT has no dropout modules (SDPA's dropout_p=0.0)"),
        "grad_sync": Cell("step", (_s("litgpt", "litgpt/finetune/lora.py", "353-354"),),
                          note="fabric.no_backward_sync while accumulating"),
    }, rules=_litgpt_rules, check=_check_litgpt, torch_derived=("zero_grad",), min_torch="2.0"),
    Preset("nanogpt", "nanoGPT train.py", "nanoGPT 3adf61e", {
        "precision": Cell("bf16-amp", (_s("nanogpt", "train.py", "73"), _s("nanogpt", "train.py", "112")),
                          note="bfloat16 autocast where supported, else float16 with a GradScaler"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell("fused", (_s("nanogpt", "model.py", "280-284"),)),
        "zero_grad": Cell("none", (_s("nanogpt", "train.py", "314"),)),
        "hold_output": Cell("step", (_s("nanogpt", "train.py", "300"),),
                            note="logits, loss = model(X, Y): the logits live until the next forward"),
        "loss": Cell("half", (_s("nanogpt", "model.py", "186-187"),),
                     note="F.cross_entropy on the autocast logits"),
        "attention": Cell("sdpa", (_s("nanogpt", "model.py", "62-64"),)),
        "recompute": Cell(shown="none"), "sharding": Cell(shown="none (DDP)"),
        "dropout": Cell(False, (_s("nanogpt", "train.py", "55"), _s("nanogpt", "train.py", "184")),
                        note="dropout = 0.0 is passed to the model"),
        "grad_sync": Cell(shown="n/a (DDP, no sharded gradients)"),
    }, check=_check_nanogpt, torch_derived=("attention", "optimizer_impl"), notes=(
        "train.py compiles the model (compile = True, train.py:74); the preset leaves --compile off because "
        "measure does not run it and trace compiles only the transformers models it builds (nanoGPT is "
        "traced from a factory): add --compile to estimate (or trace a transformers GPT-2) compiled",
    )),
    Preset("deepspeed", "DeepSpeed engine", "deepspeed 0.19.5", {
        "precision": Cell("fp32", (_s("deepspeed", "deepspeed/runtime/constants.py", "138"),
                                   _s("deepspeed", "deepspeed/runtime/constants.py", "179")),
                          note="bf16.enabled and fp16.enabled default to False; bf16 casts the model to bf16 "
                               "(--precision bf16)"),
        "master_weights": Cell(shown="fp32 with --precision bf16/fp16",
                               sources=(_s("deepspeed", "deepspeed/runtime/engine.py", "1934-1979"),
                                        _s("deepspeed", "deepspeed/runtime/fp16/fused_optimizer.py", "98"),
                                        _s("deepspeed", "deepspeed/runtime/bf16_optimizer.py", "170")),
                               note="bf16/fp16 without ZeRO (FP16_Optimizer), ZeRO-1 with fp32 gradient "
                                    "accumulation (BF16_Optimizer) and ZeRO-1/2/3 all keep fp32 partitions"),
        "optimizer_impl": Cell("fused", (_s("deepspeed", "deepspeed/runtime/engine.py", "2051-2095"),),
                               note="Adam/AdamW named in the config build FusedAdam; a client torch optimizer "
                                    "is foreach"),
        "zero_grad": Cell("none", (_s("deepspeed", "deepspeed/runtime/engine.py", "3271-3276"),
                                   _s("deepspeed", "deepspeed/runtime/bf16_optimizer.py", "491"))),
        "hold_output": Cell(shown=_NOT_SET), "loss": Cell(shown="the model's own"),
        "attention": Cell(shown="the model's (sdpa)"), "recompute": Cell(shown="none"),
        "sharding": Cell(shown="zero 0", sources=(_s("deepspeed", "deepspeed/runtime/zero/config.py", "95"),)),
        "dropout": Cell(shown="the config's"),
        "grad_sync": Cell(shown="n/a (the engine accumulates into its gradient partitions)"),
    }, rules=lambda view, model, version: _half_master(view), check=_check_deepspeed),
    Preset("megatron", "Megatron-LM pretrain_gpt.py", "megatron-core 0.19.0", {
        "precision": Cell("fp32", (_s("megatron", "megatron/core/model_parallel_config.py", "177-183"),),
                          note="fp16 and bf16 default to False; --bf16 is --precision bf16"),
        "master_weights": Cell(shown="fp32 with --precision bf16/fp16",
                               sources=(_s("megatron", "megatron/core/optimizer/optimizer_config.py", "200"),)),
        "optimizer_impl": Cell("fused", (_s("megatron", "megatron/core/optimizer/__init__.py", "14-33"),),
                               note="Transformer Engine's (or apex's) FusedAdam; torch AdamW only without both"),
        "zero_grad": Cell("zeros", (_s("megatron", "megatron/training/training.py", "2361-2364"),),
                          note="zero_grad_buffer() zeroes the contiguous gradient buffer, which stays allocated"),
        "hold_output": Cell("loss", (_s("megatron", "pretrain_gpt.py", "348-358"),
                                     _s("megatron", "megatron/core/models/gpt/gpt_model.py", "790-796"))),
        "loss": Cell("vocab-parallel", (_s("megatron", "megatron/core/tensor_parallel/cross_entropy.py", "25"),
                                        _s("megatron", "megatron/core/tensor_parallel/cross_entropy.py", "181")),
                     note="vocab_parallel_cross_entropy computes the softmax in place on one fp32 copy of the "
                          "logits and saves it; its gradient is that tensor, cast back to the logits' dtype"),
        "attention": Cell(shown="sdpa (not verified: Transformer Engine picks)",
                          sources=(_s("megatron", "megatron/core/transformer/transformer_config.py", "144"),)),
        "recompute": Cell("none", (_s("megatron", "megatron/core/transformer/transformer_config.py", "518"),)),
        "sharding": Cell(shown="distributed optimizer off",
                         sources=(_s("megatron", "megatron/core/optimizer/optimizer_config.py", "321"),)),
        "dropout": Cell(shown="the config's (not verified: Megatron's own is 0.1)",
                        sources=(_s("megatron", "megatron/core/transformer/transformer_config.py", "181-184"),),
                        note="hidden_dropout and attention_dropout default to 0.1; trainmem takes the "
                             "probabilities from the model's config"),
        "grad_sync": Cell(shown="n/a (no FSDP)"),
        "transformer_impl": Cell("transformer_engine",
                                 (_s("megatron", "megatron/core/transformer/transformer_config.py", "1220-1222"),),
                                 note="Transformer Engine's layers: its GEMM workspace is kept from the first forward "
                                      "(estimate.megatron_buffers); --transformer-impl local for Megatron's own"),
    }, rules=lambda view, model, version: _half_master(view), check=_check_megatron),
    Preset("unsloth", "Unsloth FastLanguageModel (4-bit QLoRA) with its patched TRL SFTTrainer", "unsloth 2026.3.5", {
        "precision": Cell("bf16", (_s("unsloth", "unsloth/models/llama.py", "2314-2315"),
                                   _s("unsloth", "unsloth/models/rl.py", "723-743"),
                                   _s("unsloth-zoo", "unsloth_zoo/training_utils.py", "139-177")),
                          note="from_pretrained(dtype=None) loads bf16 where supported (fp16 on older GPUs: "
                               "--precision fp16); the weights that are not 4-bit stay bf16 and frozen, the LoRA "
                               "adapters are cast to fp32 (prepare_model_for_training's upcast); the trainer "
                               "turns on bf16 autocast over them (UNSLOTH_MIXED_PRECISION float32): --precision "
                               "bf16 with --lora-dtype fp32"),
        "master_weights": Cell(shown="none"),
        "optimizer_impl": Cell(shown="bitsandbytes AdamW8bit (optim='adamw_8bit': --optimizer adamw-8bit)",
                               sources=(_s("unsloth", "unsloth/models/rl.py", "1013-1020"),)),
        "zero_grad": Cell("none", (_s("transformers", _TF + "trainer.py", "1946"),),
                          note="the HF Trainer's model.zero_grad() (set_to_none=True); Unsloth replaces "
                               "Trainer._inner_training_loop with its own copy"),
        "hold_output": Cell("loss", (_s("trl", "trl/trainer/sft_trainer.py", "1700-1832"),)),
        "loss": Cell("unsloth",
                     sources=(_s("unsloth", "unsloth/models/llama.py", "1521-1556"),
                              _s("unsloth-zoo", "unsloth_zoo/fused_losses/cross_entropy_loss.py", "134-160")),
                     note="with labels (and UNSLOTH_RETURN_LOGITS unset) CausalLM_fast_forward returns no logits "
                          "and calls unsloth_fused_ce_loss(target_gb=None, torch_compile=True): the head, "
                          "cross-entropy and its gradient in torch.compile'd chunks, saving the input gradient "
                          "(--loss unsloth). Chunks: max(4*round(tokens x vocab / (free GPU memory / 2)), 1), one "
                          "whenever the fp32 logits are smaller than the memory free at the first loss; "
                          "--loss unsloth --loss-chunks N is UNSLOTH_CE_LOSS_N_CHUNKS=N (--loss-chunks alone drops "
                          "the preset's loss, as for every preset)"),
        "attention": Cell(shown="sdpa (flash-attn, else xformers, else SDPA: the install's)",
                          sources=(_s("unsloth", "unsloth/utils/attention_dispatch.py", "93-103"),),
                          note="under --unsloth-kernels the layers count a fused kernel's saved set (q, k, v, the "
                               "output, the fp32 logsumexp: flash-attn's, xformers' and SDPA's flash/efficient "
                               "kernels alike) whatever --attention names (eager and sdpa-math are refused); with "
                               "peft's modules, --attention picks SDPA's backend"),
        "recompute": Cell("full", (_s("unsloth", "unsloth/models/llama.py", "2743"),
                                   _s("unsloth-zoo", "unsloth_zoo/gradient_checkpointing.py", "757-761")),
                          note="use_gradient_checkpointing='unsloth' (get_peft_model's default): reentrant "
                               "(UnslothCheckpointFunction), the layers' inputs offloaded to pinned host memory "
                               "(--unsloth-gc, estimate/unsloth.py); from_pretrained(max_seq_length < 512) keeps "
                               "torch's checkpoint: --no-unsloth-gc"),
        "sharding": Cell(shown="none (one GPU)"),
        "grad_sync": Cell(shown="n/a (one GPU)"),
        "dropout": Cell(shown="the config's"),
        "reentrant": Cell(True, (_s("unsloth-zoo", "unsloth_zoo/gradient_checkpointing.py", "757-761"),)),
        "unsloth_gc": Cell(True, (_s("unsloth", "unsloth/models/_utils.py", "208-216"),
                                  _s("unsloth-zoo", "unsloth_zoo/gradient_checkpointing.py", "384-634"))),
        "quantize": Cell("nf4-dq", (_s("unsloth", "unsloth/models/llama.py", "2396-2402"),),
                         note="load_in_4bit=True (loader.py L228): BitsAndBytesConfig(load_in_4bit, "
                              "bnb_4bit_use_double_quant=True, nf4, compute dtype = the model's)"),
        "unsloth_kernels": Cell(True, (_s("unsloth", "unsloth/models/llama.py", "3334-3420"),),
                                note="patch_peft_model's LoRA_QKV / LoRA_W / LoRA_MLP Functions and the fast "
                                     "RMSNorm and RoPE kernels in every layer (--unsloth-kernels): only with "
                                     "adapters on all seven projections, lora_dropout 0 and no bias (Qwen2's "
                                     "q/k/v biases: peft's modules counted, warned), else peft's modules"),
        "lora_rank": Cell(16, (_s("unsloth", "unsloth/models/llama.py", "2728"),)),
        "lora_targets": Cell(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                             (_s("unsloth", "unsloth/models/llama.py", "2729-2737"),)),
        "lora_dropout": Cell(0.0, (_s("unsloth", "unsloth/models/llama.py", "2739"),)),
        "lora_dtype": Cell("fp32", (_s("unsloth-zoo", "unsloth_zoo/training_utils.py", "143-147"),
                                    _s("unsloth-zoo", "unsloth_zoo/training_utils.py", "176"))),
        "optimizer": Cell("adamw-8bit", (_s("unsloth", "unsloth/models/rl.py", "1020"),)),
        "batch_size": Cell(4, (_s("unsloth", "unsloth/models/rl.py", "1016"),)),
        "grad_accum": Cell(2, (_s("unsloth", "unsloth/models/rl.py", "1017"),)),
    }, rules=_unsloth_rules, check=_check_unsloth, notes=(
        "the patched SFTConfig (UnslothSFTConfig, rl.py L1013-1045) defaults per_device_train_batch_size 4, "
        "gradient_accumulation_steps 2, optim 'adamw_8bit'; padding_free is switched on when left None "
        "(trainer.py L69-76): a micro-batch's samples become one row of their tokens (give --batch-size 1 "
        "--seq-len <tokens>; with equal-length samples the memory is the same)",
        "embeddings and head stay bf16 and frozen (train_embedding/train_lm_head False); modules_to_save would "
        "train them (not in the preset)",
    )),
)}

FRAMEWORKS = tuple(PRESETS)


#: other names users give a framework
FRAMEWORK_ALIASES = {"trainer": "hf-trainer", "transformers": "hf-trainer", "hf": "hf-trainer",
                     "lit-gpt": "litgpt", "pytorch-lightning": "lightning", "pl": "lightning",
                     "torch": "plain", "pytorch": "plain", "megatron-lm": "megatron", "megatron-core": "megatron"}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (or one of its ``FRAMEWORK_ALIASES``); one-line TrainmemError naming
    the nearest one otherwise."""
    key = name.strip().lower() if isinstance(name, str) else name
    key = FRAMEWORK_ALIASES.get(key, key)
    if isinstance(key, str) and key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(str(name).lower(), FRAMEWORKS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise TrainmemError(f"--framework {name!r} is not one of: {', '.join(FRAMEWORKS)}{hint}")


def parse_version(preset: Preset, version: Any) -> tuple[int, ...] | None:
    """``--framework-version`` as a tuple of ints (None when not given); a TrainmemError when the
    preset has no version rules, or the version is not a release between its oldest rule and the
    release the preset was read from (compared by major.minor)."""
    if version is None:
        return None
    if preset.oldest is None:
        raise TrainmemError(f"--framework {preset.name} has no version-dependent defaults (read from "
                            f"{preset.release}): drop --framework-version")
    text = str(version).strip().lstrip("v")
    if not re.fullmatch(r"\d+(\.\d+){0,2}", text):
        raise TrainmemError(f"--framework-version {version!r} is not a version like {preset.current}")
    v = _v(text)
    if not _v(preset.oldest)[:2] <= v[:2] <= _v(preset.current)[:2]:
        raise TrainmemError(f"--framework-version {text}: the {preset.name} preset knows "
                            f"{preset.release.rsplit(' ', 1)[0]} {preset.oldest} to {preset.current}")
    return v


def _static(preset: Preset, version: tuple[int, ...] | None) -> dict[str, Any]:
    """The cells' values, then the version rules in force at ``version`` (None: the current release)."""
    out = {c.option or k: c.value for k, c in preset.cells.items() if c.value is not None}
    if version is not None:
        for rule in preset.since:
            if _v(rule.version) <= version:
                out.pop(rule.option, None)
                if rule.value is not None:
                    out[rule.option] = rule.value
    return out


def preset_options(name: str, version: Any = None, given: Mapping[str, Any] | None = None, model: Any = None,
                   base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The TrainingSpec options preset ``name`` sets at ``version`` (None: its current release):
    the cells' values, the version rules, then the rules that read the setup (``base`` under the
    preset's values under the user's ``given`` options, e.g. ``dp``) and ``model`` (its config's
    dtype). ``given`` options are not removed from the result. Raises TrainmemError."""
    preset = get_preset(name)
    v = parse_version(preset, version)
    out = _static(preset, v)
    if preset.rules is not None:
        out.update(preset.rules({**(base or {}), **out, **(given or {})}, model, v))
    optimizer = {**(base or {}), **out, **(given or {})}.get("optimizer")
    if optimizer not in (None, "adamw", "adam") and "optimizer_impl" not in (given or {}):
        # the preset's implementation is its AdamW's (the HF Trainer's adamw_torch_fused, torchtune's and
        # torchtitan's fused=True): another optimizer runs its own default (the HF Trainer's sgd, adagrad and
        # rmsprop handlers pass no fused, trainer_optimizer.py L317-348; bitsandbytes has one kernel)
        out["optimizer_impl"] = None
    return out


def preset_warnings(name: str, version: Any, training: Any, model: Any, given: frozenset[str]) -> list[str]:
    """One line each: what in ``training`` the framework does not run, or trainmem does not count."""
    preset = get_preset(name)
    if preset.check is None:
        return []
    return preset.check(training, model, parse_version(preset, version), given)


# ----- the docs table --------------------------------------------------------------------------------
def _cell_text(c: Cell) -> str:
    value = c.shown or f"`{c.value}`"
    links = " ".join(f"[{s.text}]({s.url})" for s in c.sources)
    return value + (f" {links}" if links else "")


def markdown_table() -> str:
    """docs/frameworks.md's table (framework x option), its version rules and its notes."""
    rows = ["| framework | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    for p in PRESETS.values():
        cells = []
        for col in COLUMNS:
            c = p.cells[col]
            text = _cell_text(c)
            text += "".join(f"; {k} {_cell_text(p.cells[k])}" for k in _WITHIN.get(col, ()) if k in p.cells)
            cells.append(text)
        rows.append(f"| **{p.name}** ({p.release}) | " + " | ".join(cells) + " |")
    rows += ["", "Version rules (`--framework-version`):", "",
             "| framework | option | from version | value | source |", "|---|---|---|---|---|"]
    for p in PRESETS.values():
        for r in p.since:
            value = "—" if r.value is None else f"`{r.value}`"
            rows.append(f"| {p.name} | {r.option} | {r.version} | {value} | [{r.source.text}]({r.source.url}) |")
    rows += ["", "Older PyTorch (`--torch-version`, `spec/releases.py`): these cells are PyTorch's own defaults as the "
             "framework calls them, so an older release changes them (before 2.0: zero_grad `zeros`, "
             "optimizer_impl `for-loop`, attention `eager`); the other cells are the framework's explicit choices:", ""]
    rows += [f"- {p.name}: {', '.join(p.torch_derived)}" for p in PRESETS.values() if p.torch_derived]
    rows += [f"- {p.name} needs PyTorch {p.min_torch} or newer" for p in PRESETS.values() if p.min_torch]
    rows += ["", "Older transformers (`--transformers-version`, `spec/tf_releases.py`): `--framework hf-trainer "
             "--framework-version V` sets `--transformers-version V` for the models the release table covers (llama, "
             "mistral, qwen2, mixtral, gpt2, bert, OPT, Granite), so the release's model code is counted: eager attention "
             "before the family's SDPA support (the attention cell, like PyTorch's defaults, gives way), the loss's "
             "logits copies before 4.49 and the KV cache's own keys and values (no copies) before 4.56; other models "
             "keep the installed code, with a warning. Before 5.0 `--recompute full` on every layer is also "
             "`--reentrant` (`gradient_checkpointing_enable`'s `use_reentrant=True`; docs/recompute.md)."]
    rows += ["", "Notes:", ""]
    for p in PRESETS.values():
        for k, c in p.cells.items():
            if c.note:
                rows.append(f"- {p.name} · {k}: {c.note}")
        rows += [f"- {p.name}: {n}" for n in p.notes]
    return "\n".join(rows)
