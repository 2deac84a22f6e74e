"""Which path a state-space or linear-attention model's mixer takes in transformers, and the report's line.

transformers 5.24 decorates these mixers' scan and convolution functions with
``use_kernel_func_from_hub_with_fallback(name, package)`` (``integrations/hub_kernels.py`` L990-1055): the
function is, in order, the Hugging Face ``kernels`` hub's (only when the model is kernelized, ``use_kernels=True``),
the original package's when it imports (``mamba_ssm``, ``causal_conv1d``, ``fla``), else transformers' own
reference PyTorch function (with the warning "falling back to its reference PyTorch implementation ... much
slower"). In training (``self.training and cache is None``) Mamba's mixer then runs ``mamba_inner_fn`` and
Mamba-2's ``mamba_split_conv1d_scan_combined`` (``models/mamba/modeling_mamba.py`` L381-400,
``models/mamba2/modeling_mamba2.py`` L483-506), fused autograd functions whose saved tensors are not the
reference path's; without the package they return None and the reference path runs: Mamba's sequential
scan over the sequence (``mamba_selective_scan`` L261-265), Mamba-2's chunked scan (``mamba2_chunk_scan``
L257-362).

trainmem's trace runs the installed transformers on fake tensors with none of these packages (their Triton
and CUDA kernels cannot run there), so trace and the coefficients derived from it model the reference path,
as a GPU run takes it without the packages. With them installed a GPU run keeps other (in general fewer)
tensors: not modelled, said in one line, except where ``TrainingSpec.mixer_kernels`` is "fused" for a model
type of ``FUSED_MODULES`` (Qwen3.5's and Qwen3-Next's gated delta net: ``trainmem.fla_modules`` emulates
flash-linear-attention's and causal-conv1d's Functions there).
"""
from __future__ import annotations

#: the model types whose transformers 5.24 modeling file routes a mixer through
#: ``use_kernel_func_from_hub_with_fallback`` and the packages it falls back from (``models/*/modeling_*.py``:
#: the decorators' ``"mamba_ssm"``, ``"causal_conv1d"`` and ``"fla"`` arguments)
KERNEL_PACKAGES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "mamba", "mamba2",
                     "nemotron_h", "zamba2"), ("mamba-ssm", "causal-conv1d")),
    **dict.fromkeys(("inkling", "inkling2", "inkling2_loop", "lfm2", "lfm2_moe", "lfm3", "zamba"),
                    ("causal-conv1d",)),
    **dict.fromkeys(("bailing_hybrid", "glm5_next", "kimi_linear", "lara_mini", "olmo_hybrid", "qwen3_5",
                     "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen4_exp",
                     "qwen4_exp_text"), ("flash-linear-attention", "causal-conv1d")),
}


#: ``MIXER_KERNELS``: the path a mixer of ``KERNEL_PACKAGES`` is modelled on (``TrainingSpec.mixer_kernels``)
MIXER_KERNELS = ("reference", "fused")
#: the model types whose mixer trainmem runs on the fused path (``trainmem.fla_modules``) -> their transformers
#: modeling module (each calls ``torch_chunk_gated_delta_rule`` and ``causal_conv1d_fn`` in its gated delta net;
#: qwen3_5_moe's file is generated from qwen3_5's modular file)
FUSED_MODULES: dict[str, str] = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
                                 "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}

#: the package releases whose Functions ``trainmem.fla_modules`` emulates (part of the derived coefficients' key)
FUSED_RELEASES = "flash-linear-attention 0.5.2, causal-conv1d 1.6.1.post4"


def fused_problem(model_type: str, name: str) -> str | None:
    """Why ``--mixer-kernels fused`` cannot be modelled for this model (None: it can)."""
    if model_type in FUSED_MODULES:
        return None
    return (f"--mixer-kernels fused models flash-linear-attention's and causal-conv1d's kernels in the gated delta "
            f"net of {', '.join(sorted(FUSED_MODULES))}; {name} ({model_type or 'no model type'}) has no such mixer "
            f"modelled: drop --mixer-kernels")


def reference_path_note(model_type: str, mixer_kernels: str = "reference") -> str:
    """The report's line for a model whose mixer has a fused-kernel path (``KERNEL_PACKAGES``); "" otherwise.
    ``mixer_kernels`` "fused" (a type of ``FUSED_MODULES``): the line says which kernels were modelled."""
    packages = KERNEL_PACKAGES.get(model_type)
    if not packages:
        return ""
    if mixer_kernels == "fused":
        return (f"{model_type}: its gated delta net modelled on flash-linear-attention 0.5's and causal-conv1d "
                f"1.6's fused kernels (--mixer-kernels fused), as a GPU run takes it with both installed")
    names = " and ".join(packages)
    fused = "give --mixer-kernels fused to model them" if model_type in FUSED_MODULES else "not modelled"
    return (f"{model_type}: modelled on transformers' reference PyTorch path of its mixer, which a GPU run takes "
            f"without {names} installed; with them installed it runs their fused kernels, which keep other "
            f"tensors ({fused})")
