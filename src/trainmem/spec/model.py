"""ModelSpec: a transformer's architecture, and its exact parameter tensors.

A ModelSpec knows nothing about how the model is trained. It is built from a Hugging Face
``config.json`` (see ``trainmem.spec.config``) or directly. ``parameter_tensors()`` lists every
trainable tensor with its shape, in the order the model registers them, so that the parameter
count equals what transformers builds from the same config.
"""
from __future__ import annotations

from dataclasses import dataclass, field, asdict
from functools import cached_property
from math import prod
from typing import Any, Mapping

from ..errors import TrainmemError

FAMILIES = ("gpt2", "nanogpt", "bert", "roberta-prenorm", "llama", "mixtral", "gpt-next", "derived")
HEADS = ("causal-lm", "masked-lm", "seq-cls", "qa", "base", "seq2seq-lm", "image-cls", "vlm", "speech-seq2seq", "ctc")
ACTIVATIONS = ("gelu", "swiglu", "relu")
NORMS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class ParamTensor:
    """One trainable tensor.

    ``role``: ``embedding`` (lookup table), ``linear`` (a matmul weight: cast to half under
    autocast and cached), ``bias``, ``norm``, ``router`` (MoE gate, a matmul weight too),
    ``expert`` (a matmul weight held by one MoE expert; only top-k of them see each token).
    ``module`` is the Hugging Face-style leaf name (``q_proj``, ``c_attn``, ``query``) that peft's
    LoRA targets match. ``layer`` is the transformer layer index, None outside the layers.
    """

    name: str
    shape: tuple[int, ...]
    role: str
    module: str = ""
    layer: int | None = None

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def is_matmul(self) -> bool:
        return self.role in ("linear", "router", "expert")


@dataclass(frozen=True)
class BufferTensor:
    """A registered, non-trainable tensor that moves to the GPU with the model."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64", "bool", or "model" (the model's parameter dtype)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder or encoder transformer, as its config describes it."""

    name: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    ffn_size: int
    activation: str = "gelu"
    num_kv_heads: int | None = None
    head_dim: int | None = None
    max_positions: int = 2048
    norm: str = "layernorm"
    head: str = "causal-lm"
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = True
    tied_embeddings: bool = True
    position: str = "learned"  # learned | rotary
    type_vocab_size: int = 0
    num_labels: int = 2
    num_experts: int = 0
    experts_top_k: int = 0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    causal_mask_buffer: bool = False  # nanoGPT's per-layer (T, T) tril buffer
    manual_layernorm: bool = False  # LayerNorm in Python ops (Raschka's LLMs-from-scratch ``LayerNorm``)
    separate_qkv: bool = False  # GPT-2-shaped model with q, k, v as three linears (Raschka's W_query/W_key/W_value)
    qk_norm: bool = False   # Qwen3: an RMSNorm over head_dim on each head's query and key (q_norm, k_norm)
    pre_norm: bool = True
    embedding_norm: bool = False
    final_norm: bool = True
    decoder_layers: int = 0  # an encoder-decoder (head seq2seq-lm): the last decoder_layers of num_layers
    image_size: int = 0      # an image model (head image-cls): the config's square image side in pixels
    patch_size: int = 0      # ... its patch side: a sequence of (image_size / patch_size)^2 patches
    num_channels: int = 3    # ... colour channels of its pixel values
    class_tokens: int = 0    # ... tokens added to the patches (ViT's class token)
    mel_bins: int = 0        # a speech seq2seq model (head speech-seq2seq, Whisper): log-mel channels of its input
    source_positions: int = 0  # ... its encoder's fixed positions (Whisper: 1500, from 3000 mel frames)
    architecture: str = ""  # the config's architectures[0], e.g. "LlamaForCausalLM"
    model_type: str = ""
    fingerprint: str = ""  # family "derived": the config's hash, which names its profile (spec.profile)
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise TrainmemError(f"model {self.name!r}: unknown family {self.family!r} (known: {', '.join(FAMILIES)})")
        if self.head not in HEADS:
            raise TrainmemError(f"model {self.name!r}: unknown head {self.head!r} (known: {', '.join(HEADS)})")
        if self.activation not in ACTIVATIONS:
            raise TrainmemError(f"model {self.name!r}: unsupported activation {self.activation!r}")
        if self.norm not in NORMS:
            raise TrainmemError(f"model {self.name!r}: unsupported norm {self.norm!r}")
        for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "ffn_size", "max_positions"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise TrainmemError(f"model {self.name!r}: {key} must be a positive integer, got {v!r}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise TrainmemError(
                    f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_heads}; set head_dim in the config")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise TrainmemError(
                f"model {self.name!r}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}")
        if self.num_experts < 0 or self.experts_top_k < 0 or (self.num_experts and not 0 < self.experts_top_k <= self.num_experts):
            raise TrainmemError(
                f"model {self.name!r}: experts_top_k must be between 1 and num_experts ({self.num_experts}), "
                f"got {self.experts_top_k}")
        for key in ("hidden_dropout", "attention_dropout"):
            v = getattr(self, key)
            if not 0.0 <= v < 1.0:
                raise TrainmemError(f"model {self.name!r}: {key} must be in [0, 1), got {v}")

    # ----- sizes ---------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection output (heads x head_dim)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim

    @property
    def learned_positions(self) -> bool:
        """Whether positions come from a table as long as the context (learned embeddings, or MPT's
        ALiBi bias built for ``max_seq_len``: ``spec.config._derived_position``), so that a longer
        sequence cannot run."""
        return self.family in ("gpt2", "nanogpt", "bert", "roberta-prenorm") or (
            self.family == "derived" and self.position in ("learned", "bias-table"))

    @property
    def is_image(self) -> bool:
        """An image model: its sequence is its patches, read from ``--image-size``."""
        return self.head == "image-cls"

    @property
    def is_vlm(self) -> bool:
        """A vision-language model (``--task image-text-to-text``): a causal LM whose ids carry image
        placeholders (``--images``, ``--image-size``; ``spec.vision``)."""
        return self.head == "vlm"

    @property
    def is_encoder_decoder(self) -> bool:
        return self.head in ("seq2seq-lm", "speech-seq2seq") and self.decoder_layers > 0

    @property
    def is_speech_seq2seq(self) -> bool:
        """A speech encoder-decoder (Whisper): its encoder's length is fixed by its config
        (``source_positions``), its input log-mel features; ``--target-len`` is the decoder's tokens."""
        return self.head == "speech-seq2seq" and self.decoder_layers > 0

    @property
    def mel_frames(self) -> int:
        """The log-mel frames of a speech seq2seq model's input: twice its encoder positions
        (transformers 5.24 ``models/whisper/modeling_whisper.py`` L611-615: ``WhisperEncoder.forward``
        refuses any length but ``max_source_positions * conv1.stride * conv2.stride``, strides 1 and 2)."""
        return 2 * self.source_positions

    def image_tokens(self, image_size: int) -> int:
        """The sequence of an ``image_size`` x ``image_size`` image: its patches and class tokens
        (transformers ``ViTPatchEmbeddings``: a convolution of stride ``patch_size``; ``ViTEmbeddings``
        prepends the class token)."""
        return (image_size // self.patch_size) ** 2 + self.class_tokens

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_causal(self) -> bool:
        return self.family not in ("bert", "roberta-prenorm")

    # ----- tensors -------------------------------------------------------------------------
    @cached_property
    def _tensors(self) -> tuple[ParamTensor, ...]:
        from .architectures import build_parameter_tensors
        return tuple(build_parameter_tensors(self))

    def parameter_tensors(self) -> tuple[ParamTensor, ...]:
        """Every trainable tensor, tied ones once, in registration order."""
        return self._tensors

    @cached_property
    def _buffers(self) -> tuple[BufferTensor, ...]:
        from .architectures import build_buffer_tensors
        return tuple(build_buffer_tensors(self))

    def buffer_tensors(self) -> tuple[BufferTensor, ...]:
        """Registered buffers that move to the device with the model."""
        return self._buffers

    @cached_property
    def uniform_layers(self) -> bool:
        """Whether every layer has the same tensors (the hand-written families always; a derived
        architecture unless its layers differ, e.g. DeepSeek's dense first layers)."""
        if self.family != "derived":
            return True
        from .profile import profile_for
        return profile_for(self.config).uniform

    @cached_property
    def first_layer_and_outer_tensors(self) -> tuple[ParamTensor, ...]:
        """The tensors outside the layers and those of layer 0, in registration order: when all
        layers are identical (``uniform_layers``), sums over a model need only these."""
        return tuple(t for t in self._tensors if t.layer is None or t.layer == 0)

    @cached_property
    def num_params(self) -> int:
        """Exact number of trainable parameters (tied tensors counted once)."""
        return sum(t.numel for t in self._tensors)

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one transformer layer (the average layer when they differ)."""
        if not self.uniform_layers:
            return sum(t.numel for t in self._tensors if t.layer is not None) // self.num_layers
        return sum(t.numel for t in self._tensors if t.layer == 0)

    @cached_property
    def embedding_params(self) -> int:
        """Parameters outside the transformer layers (embeddings, final norm, heads)."""
        return self.num_params - self.num_layers * self.layer_params

    @cached_property
    def active_params(self) -> int:
        """Parameters a token passes through (MoE: only top-k experts)."""
        if not self.is_moe:
            return self.num_params
        expert = sum(t.numel for t in self._tensors if t.role == "expert")
        return self.num_params - expert + expert * self.experts_top_k // self.num_experts

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "config"}
        d["num_params"] = self.num_params
        return d
