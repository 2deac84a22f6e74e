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
and CUDA kernels cannot run there), so by default (``TrainingSpec.mixer_kernels`` "reference") trace and the
coefficients derived from it model the reference path, as a GPU run takes it without the packages.
``--mixer-kernels fused`` models the packages' path where trainmem emulates their Functions' memory: the
mixers whose training forward is one of mamba-ssm's fused autograd Functions (``FUSED_FUNCTIONS``,
``trainmem.mamba_kernels``) and Qwen3.5's and Qwen3-Next's gated delta net under flash-linear-attention's and
causal-conv1d's kernels (``FUSED_MODULES``, ``trainmem.fla_modules``): trace swaps the modeling file's
function for the emulation, and the derived coefficients come from that trace. Other mixers with kernels
(Jamba's, which calls ``causal_conv1d_fn`` and ``selective_scan_fn`` apart; the causal-conv1d-only ones and
the other flash-linear-attention ones) are refused under "fused" in one line.
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

#: the package releases whose Functions ``trainmem.fla_modules`` and ``trainmem.mamba_kernels`` emulate (part of
#: the derived coefficients' key: ``fused_releases``)
FLA_RELEASES = "flash-linear-attention 0.5.2, causal-conv1d 1.6.1.post4"
MAMBA_RELEASES = "mamba-ssm 2.2.6.post3, causal-conv1d 1.5.2"


def fused_releases(model_type: str) -> str:
    """The emulated package releases of ``model_type``'s fused path ("" for a model without one)."""
    return FLA_RELEASES if model_type in FUSED_MODULES else MAMBA_RELEASES if model_type in FUSED_FUNCTIONS else ""


#: the model types whose mixer's training forward (``self.training and cache is None``) is one fused autograd
#: Function of mamba-ssm, and that function's name in the transformers 5.24 modeling file
#: (``models/mamba/modeling_mamba.py`` L381-400, ``models/falcon_mamba/modeling_falcon_mamba.py`` L404-425:
#: ``mamba_inner_fn``; ``models/mamba2/modeling_mamba2.py`` L483-506 and the same lines of Bamba's, Falcon-H1's,
#: Granite 4.0-H's, Nemotron-H's and Zamba2's: ``mamba2_split_conv1d_scan_combined``, mamba-ssm's
#: ``mamba_split_conv1d_scan_combined``)
FUSED_FUNCTIONS: dict[str, str] = {
    **dict.fromkeys(("mamba", "falcon_mamba"), "mamba_inner_fn"),
    **dict.fromkeys(("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"),
                    "mamba2_split_conv1d_scan_combined"),
}


#: the hybrids whose model builds its cache in training when ``use_cache`` is on (the config's default, unless
#: gradient checkpointing turns it off: ``utils/generic.py`` ``merge_with_config_defaults`` L1113-1160), and
#: whose mixer then skips the fused function (``if self.training and cache is None``): transformers 5.24
#: ``models/granitemoehybrid/modeling_granitemoehybrid.py`` L1086-1087 and L600, the same in Bamba's (L969),
#: Falcon-H1's (L1067), Nemotron-H's (L1112) and Zamba2's (L1177). Mamba's and Mamba-2's models turn
#: ``use_cache`` off in training (``modeling_mamba.py`` L664, ``modeling_mamba2.py`` L786)
CACHE_IN_TRAINING = frozenset({"bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"})


def fused_path_problem(model_type: str) -> str | None:
    """Why ``--mixer-kernels fused`` cannot be modelled for ``model_type`` (None: it can)."""
    if model_type in FUSED_FUNCTIONS or model_type in FUSED_MODULES:
        return None
    if model_type in KERNEL_PACKAGES:
        return (f"--mixer-kernels fused: {model_type}'s mixer runs {' and '.join(KERNEL_PACKAGES[model_type])} "
                f"kernels other than mamba-ssm's fused Mamba / Mamba-2 Functions and flash-linear-attention's "
                f"gated delta rule, not modelled: drop it (the reference path is modelled)")
    return (f"--mixer-kernels fused: {model_type or 'this model'} has no state-space mixer with a fused-kernel "
            f"path: drop it")


def reference_path_note(model_type: str, mixer_kernels: str = "reference", cache_built: bool = False) -> str:
    """The report's line saying which path of the mixer is modelled, for a model whose mixer has a
    fused-kernel path (``KERNEL_PACKAGES``); "" otherwise. ``cache_built``: the run's model builds its
    cache in training (``CACHE_IN_TRAINING`` and ``use_cache`` on), so its mixers skip the fused path."""
    packages = KERNEL_PACKAGES.get(model_type)
    if not packages:
        return ""
    names = " and ".join(packages)
    if mixer_kernels == "fused" and cache_built:
        return (f"{model_type}: --mixer-kernels fused, but the model builds its cache in training (use_cache on, "
                f"no --recompute full) and transformers calls the fused function only without one "
                f"(self.training and cache is None): its mixers run the reference PyTorch path all the same, "
                f"as modelled; --use-cache false (or --recompute full) takes the fused path")
    if mixer_kernels == "fused" and model_type in FUSED_MODULES:
        return (f"{model_type}: its gated delta net modelled on flash-linear-attention 0.5's and causal-conv1d "
                f"1.6's fused kernels (--mixer-kernels fused), as a GPU run takes it with both installed")
    if mixer_kernels == "fused":
        return (f"{model_type}: modelled on the fused-kernel path of its mixer (mamba-ssm's "
                f"{FUSED_FUNCTIONS[model_type].replace('mamba2_', 'mamba_')}), which a GPU run takes with {names} "
                f"installed (--mixer-kernels fused)")
    fused = "give --mixer-kernels fused to model them" if not fused_path_problem(model_type) else "not modelled"
    return (f"{model_type}: modelled on transformers' reference PyTorch path of its mixer, which a GPU run takes "
            f"without {names} installed; with them installed it runs their fused kernels, which keep other "
            f"tensors ({fused})")


#: the module each package of ``KERNEL_PACKAGES`` imports as
PACKAGE_MODULES = {"mamba-ssm": "mamba_ssm", "causal-conv1d": "causal_conv1d", "flash-linear-attention": "fla"}


def measured_path_note(model_type: str, mixer_kernels: str, installed: bool, on_cuda: bool) -> str:
    """measure's line on the mixer path the installed packages made the run take ("" for a model without a
    fused-kernel path); ``installed``: every package of ``KERNEL_PACKAGES[model_type]`` imports. Raises
    TrainmemError for ``--mixer-kernels fused`` that the run cannot take."""
    packages = KERNEL_PACKAGES.get(model_type)
    if not packages:
        return ""
    names = " and ".join(packages)
    if mixer_kernels == "fused" and not (installed and on_cuda):
        from ..errors import TrainmemError
        why = f"{names} do not import here" if not installed else "their kernels run on CUDA only"
        raise TrainmemError(f"--mixer-kernels fused: measure runs the path the installed packages decide and "
                            f"{why}: install them on the GPU machine, or drop --mixer-kernels")
    ran = "fused-kernel" if installed and on_cuda else "reference PyTorch"
    return (f"{model_type}: measure ran the {ran} path of its mixer ({names} "
            f"{'installed' if installed else 'not installed'}{'' if on_cuda else ', CPU'})")
