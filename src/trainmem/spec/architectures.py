"""Parameter and buffer tensors of each model family, as transformers (or nanoGPT) registers them.

Shapes follow PyTorch's (out_features, in_features) convention for linear weights, except GPT-2's
Conv1D (in, out) as transformers stores it. Tied tensors appear once. Tests compare the total
with the transformers model built from the same config on the meta device.
"""
from __future__ import annotations

from typing import Iterator

from .model import BufferTensor, ModelSpec, ParamTensor


def _norm(s: ModelSpec, name: str, module: str, layer: int | None) -> Iterator[ParamTensor]:
    yield ParamTensor(f"{name}.weight", (s.hidden_size,), "norm", module, layer)
    if s.norm == "layernorm" and s.norm_bias:
        yield ParamTensor(f"{name}.bias", (s.hidden_size,), "norm", module, layer)


def _linear(name: str, out_f: int, in_f: int, bias: bool, module: str, layer: int | None,
            role: str = "linear") -> Iterator[ParamTensor]:
    yield ParamTensor(f"{name}.weight", (out_f, in_f), role, module, layer)
    if bias:
        yield ParamTensor(f"{name}.bias", (out_f,), "bias", module, layer)


def _gpt2(s: ModelSpec) -> Iterator[ParamTensor]:
    h, f = s.hidden_size, s.ffn_size
    b = s.mlp_bias  # GPT-2 (transformers) always has biases; nanoGPT's bias=False has none
    yield ParamTensor("wte.weight", (s.vocab_size, h), "embedding", "wte")
    yield ParamTensor("wpe.weight", (s.max_positions, h), "embedding", "wpe")
    for i in range(s.num_layers):
        p = f"h.{i}"
        yield from _norm(s, f"{p}.ln_1", "ln_1", i)
        # Conv1D stores (in, out); the matmul is the same either way.
        qkv = s.q_size + 2 * s.kv_size  # 3 h (grouped heads: ``_trainmem.num_kv_heads``, spec.config._gpt2_spec)
        yield ParamTensor(f"{p}.attn.c_attn.weight", (h, qkv), "linear", "c_attn", i)
        if b and s.qkv_bias:  # Raschka's GPTModel: qkv_bias=False, the other biases kept
            yield ParamTensor(f"{p}.attn.c_attn.bias", (qkv,), "bias", "c_attn", i)
        yield ParamTensor(f"{p}.attn.c_proj.weight", (h, h), "linear", "c_proj", i)
        if b:
            yield ParamTensor(f"{p}.attn.c_proj.bias", (h,), "bias", "c_proj", i)
        yield from _norm(s, f"{p}.ln_2", "ln_2", i)
        yield ParamTensor(f"{p}.mlp.c_fc.weight", (h, f), "linear", "c_fc", i)
        if b:
            yield ParamTensor(f"{p}.mlp.c_fc.bias", (f,), "bias", "c_fc", i)
        yield ParamTensor(f"{p}.mlp.c_proj.weight", (f, h), "linear", "c_proj", i)
        if b:
            yield ParamTensor(f"{p}.mlp.c_proj.bias", (h,), "bias", "c_proj", i)
    yield from _norm(s, "ln_f", "ln_f", None)
    yield from _head(s)


def _bert(s: ModelSpec) -> Iterator[ParamTensor]:
    h, f = s.hidden_size, s.ffn_size
    yield ParamTensor("embeddings.word_embeddings.weight", (s.vocab_size, h), "embedding", "word_embeddings")
    if s.family == "bert":
        yield ParamTensor("embeddings.position_embeddings.weight", (s.max_positions, h), "embedding",
                          "position_embeddings")
        yield ParamTensor("embeddings.token_type_embeddings.weight", (s.type_vocab_size, h), "embedding",
                          "token_type_embeddings")
    else:  # XLM-RoBERTa-XL registers token types first
        yield ParamTensor("embeddings.token_type_embeddings.weight", (s.type_vocab_size, h), "embedding",
                          "token_type_embeddings")
        yield ParamTensor("embeddings.position_embeddings.weight", (s.max_positions, h), "embedding",
                          "position_embeddings")
    if s.embedding_norm:
        yield from _norm(s, "embeddings.LayerNorm", "LayerNorm", None)
    for i in range(s.num_layers):
        p = f"encoder.layer.{i}"
        for m in ("query", "key", "value"):
            yield from _linear(f"{p}.attention.self.{m}", h, h, True, m, i)
        yield from _linear(f"{p}.attention.output.dense", h, h, True, "dense", i)
        if s.pre_norm:
            yield from _norm(s, f"{p}.attention.self_attn_layer_norm", "self_attn_layer_norm", i)
        else:
            yield from _norm(s, f"{p}.attention.output.LayerNorm", "LayerNorm", i)
        yield from _linear(f"{p}.intermediate.dense", f, h, True, "dense", i)
        yield from _linear(f"{p}.output.dense", h, f, True, "dense", i)
        yield from _norm(s, f"{p}.output.LayerNorm" if not s.pre_norm else f"{p}.LayerNorm", "LayerNorm", i)
    if s.final_norm:
        yield from _norm(s, "encoder.LayerNorm", "LayerNorm", None)
    # BertModel and XLMRobertaXLModel keep their pooler; of the heads only BERT's classifier uses it
    if s.head == "base" or (s.head == "seq-cls" and s.family == "bert"):
        yield from _linear("pooler.dense", h, h, True, "dense", None)
    yield from _head(s)


def _llama(s: ModelSpec) -> Iterator[ParamTensor]:
    h, f = s.hidden_size, s.ffn_size
    yield ParamTensor("embed_tokens.weight", (s.vocab_size, h), "embedding", "embed_tokens")
    for i in range(s.num_layers):
        p = f"layers.{i}"
        yield from _linear(f"{p}.self_attn.q_proj", s.q_size, h, s.qkv_bias, "q_proj", i)
        yield from _linear(f"{p}.self_attn.k_proj", s.kv_size, h, s.qkv_bias, "k_proj", i)
        yield from _linear(f"{p}.self_attn.v_proj", s.kv_size, h, s.qkv_bias, "v_proj", i)
        yield from _linear(f"{p}.self_attn.o_proj", h, s.q_size, s.out_bias, "o_proj", i)
        if s.qk_norm:  # Qwen3: per-head RMSNorm weights of (head_dim,), replicated under TP
            yield ParamTensor(f"{p}.self_attn.q_norm.weight", (s.head_dim,), "norm", "q_norm", i)
            yield ParamTensor(f"{p}.self_attn.k_norm.weight", (s.head_dim,), "norm", "k_norm", i)
        if s.is_moe:
            e = s.num_experts
            yield ParamTensor(f"{p}.mlp.gate.weight", (e, h), "router", "gate", i)
            yield ParamTensor(f"{p}.mlp.experts.gate_up_proj", (e, 2 * f, h), "expert", "experts", i)
            yield ParamTensor(f"{p}.mlp.experts.down_proj", (e, h, f), "expert", "experts", i)
        else:
            yield from _linear(f"{p}.mlp.gate_proj", f, h, s.mlp_bias, "gate_proj", i)
            yield from _linear(f"{p}.mlp.up_proj", f, h, s.mlp_bias, "up_proj", i)
            yield from _linear(f"{p}.mlp.down_proj", h, f, s.mlp_bias, "down_proj", i)
        yield from _norm(s, f"{p}.input_layernorm", "input_layernorm", i)
        yield from _norm(s, f"{p}.post_attention_layernorm", "post_attention_layernorm", i)
    yield from _norm(s, "norm", "norm", None)
    yield from _head(s)


def _head(s: ModelSpec) -> Iterator[ParamTensor]:
    h, v = s.hidden_size, s.vocab_size
    if s.head == "causal-lm":
        if not s.tied_embeddings:
            yield ParamTensor("lm_head.weight", (v, h), "linear", "lm_head")
    elif s.head == "masked-lm":
        if s.family == "bert":
            yield from _linear("cls.predictions.transform.dense", h, h, True, "dense", None)
            yield from _norm(s, "cls.predictions.transform.LayerNorm", "LayerNorm", None)
            if not s.tied_embeddings:
                yield ParamTensor("cls.predictions.decoder.weight", (v, h), "linear", "decoder")
            yield ParamTensor("cls.predictions.bias", (v,), "bias", "decoder")
        else:
            yield ParamTensor("lm_head.bias", (v,), "bias", "decoder")
            yield from _linear("lm_head.dense", h, h, True, "dense", None)
            yield from _norm(s, "lm_head.layer_norm", "layer_norm", None)
            if not s.tied_embeddings:
                yield ParamTensor("lm_head.decoder.weight", (v, h), "linear", "decoder")
    elif s.head == "seq-cls":
        n = s.num_labels
        if s.family == "bert":
            yield from _linear("classifier", n, h, True, "classifier", None)
        elif s.family == "roberta-prenorm":
            yield from _linear("classifier.dense", h, h, True, "dense", None)
            yield from _linear("classifier.out_proj", n, h, True, "out_proj", None)
        else:  # decoder models score the last token with a bias-free linear
            yield ParamTensor("score.weight", (n, h), "linear", "score")
    elif s.head == "qa":
        # extractive QA: a start and an end logit per token from the encoder's output, Linear(h, 2)
        # with bias (transformers 5.24 bert/modeling_bert.py L1300-1301, BertForQuestionAnswering:
        # ``BertModel(config, add_pooling_layer=False)``, ``nn.Linear(config.hidden_size,
        # config.num_labels)``, num_labels 2; GPT2ForQuestionAnswering's and
        # LlamaForQuestionAnswering's ``qa_outputs`` alike)
        yield from _linear("qa_outputs", s.num_labels, h, True, "qa_outputs", None)


def build_parameter_tensors(s: ModelSpec) -> list[ParamTensor]:
    """All trainable tensors of ``s`` in registration order (tied tensors once)."""
    if s.family == "derived":
        from .profile import profile_for
        return profile_for(s.config).parameter_tensors()
    if s.family in ("gpt2", "nanogpt"):
        return list(_gpt2(s))
    if s.family in ("bert", "roberta-prenorm"):
        return list(_bert(s))
    return list(_llama(s))


def build_buffer_tensors(s: ModelSpec) -> list[BufferTensor]:
    """Registered buffers: position/token-type ids (BERT), rotary frequencies, nanoGPT masks."""
    out: list[BufferTensor] = []
    if s.family == "derived":
        from .profile import profile_for
        return list(profile_for(s.config).buffers)
    if s.family in ("bert", "roberta-prenorm"):
        out.append(BufferTensor("embeddings.position_ids", (1, s.max_positions), "int64"))
        out.append(BufferTensor("embeddings.token_type_ids", (1, s.max_positions), "int64"))
    if s.position == "rotary":
        # transformers keeps inv_freq and original_inv_freq (head_dim/2 fp32 each) on the model
        out.append(BufferTensor("rotary_emb.inv_freq", (s.head_dim // 2,), "float32"))
        out.append(BufferTensor("rotary_emb.original_inv_freq", (s.head_dim // 2,), "float32"))
    if s.causal_mask_buffer:
        for i in range(s.num_layers):
            out.append(BufferTensor(f"h.{i}.attn.bias", (1, 1, s.max_positions, s.max_positions), "float32"))
    return out
