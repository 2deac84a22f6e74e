"""What one transformer layer saves for backward, op by op, in the dtype PyTorch really stores.

Every tensor is a pair of coefficients so that a layer's recipe is built once per (model, setup)
and evaluated for any batch and sequence length:

    elements = tok * (b * s) + sq * (b * s * s_kv)

``tok`` counts elements per token, ``sq`` per (query, key) pair (attention scores). Bytes follow
from the dtype: under autocast (CUDA policy, torch.amp) matmuls run in half precision and their
inputs are cast copies that autograd saves; ``layer_norm``, ``softmax``, ``log_softmax``, ``pow``
and the losses run in fp32; the residual stream keeps the embedding's dtype (fp32 with fp32
weights). Dropout saves a 1-byte bool mask on CUDA and nothing when p == 0. These rules come from
PyTorch's autocast op lists (aten/src/ATen/autocast_mode.cpp), its autograd formulas
(tools/autograd/derivatives.yaml) and the Hugging Face / nanoGPT model code the recipe mirrors
(the comment on each builder names the module). The tracer (``trainmem.trace``) runs the real
code and checks these recipes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

F32, HALF = 4, 2


@dataclass(frozen=True)
class T:
    """A symbolic tensor: per-token and per-(token x key) element coefficients, and dtype bytes."""

    tok: float
    sq: float
    nbytes: int
    name: str = ""

    def bytes_coef(self) -> tuple[float, float]:
        return self.tok * self.nbytes, self.sq * self.nbytes


@dataclass
class Recipe:
    """Accumulates the tensors a layer saves (each storage once), the tensors the model's output
    holds without autograd saving them (``held``), and its backward transients.

    ``weights`` counts the matmul weight elements of the linears built so far (forward order): the
    backward of an op runs after the backward of every later op, whose weight gradients exist then.
    """

    saved: dict[int, T] = field(default_factory=dict)
    held: dict[int, T] = field(default_factory=dict)
    cache: float = 0.0  # bytes per token of the KV-cache copies the model output references
    transients: list[tuple[str, float, float, float, float, float, float]] = field(default_factory=list)
    weights: float = 0.0

    def save(self, *ts: T) -> None:
        for t in ts:
            self.saved[id(t)] = t

    def hold(self, *ts: T) -> None:
        for t in ts:
            self.held[id(t)] = t

    def transient(self, name: str, *ts: T, const: float = 0.0, own_weights: float = 0.0) -> None:
        """A moment of this op's backward where ``ts`` are alive. Ops after it in forward order
        were back-propagated already, so only the tensors saved so far are still alive then:
        the recorded excess is relative to the whole layer's saved tensors. ``own_weights``: the
        weight elements of this op (a linear), whose gradient is part of ``const``."""
        tok = sum(t.tok * t.nbytes for t in ts)
        sq = sum(t.sq * t.nbytes for t in ts)
        so_tok = sum(t.tok * t.nbytes for t in self.saved.values())
        so_sq = sum(t.sq * t.nbytes for t in self.saved.values())
        self.transients.append((name, tok, sq, const, so_tok, so_sq, self.weights + own_weights))

    def coefficients(self) -> tuple[float, float, dict[str, tuple[float, float]]]:
        """(bytes per token, bytes per token x key, per-name breakdown) of the saved tensors."""
        tok = sq = 0.0
        parts: dict[str, tuple[float, float]] = {}
        for t in self.saved.values():
            a, b = t.bytes_coef()
            tok += a
            sq += b
            key = t.name or "other"
            pa, pb = parts.get(key, (0.0, 0.0))
            parts[key] = (pa + a, pb + b)
        return tok, sq, parts


@dataclass(frozen=True)
class Policy:
    """Dtype policy of a precision setting."""

    amp: bool        # autocast active (fp32 weights, half matmuls)
    half: int        # bytes of the half type used by matmuls (2, or 4 in fp32 training)
    stream: int      # bytes of the residual stream (the embedding's dtype)
    weight: int      # bytes of a weight as stored

    @staticmethod
    def of(precision: str) -> "Policy":
        if precision == "fp32":
            return Policy(False, F32, F32, F32)
        if precision in ("bf16-amp", "fp16-amp"):
            return Policy(True, HALF, F32, F32)
        return Policy(False, HALF, HALF, HALF)


class Builder:
    """Helpers that mirror single PyTorch ops: what each saves and what it returns."""

    def __init__(self, pol: Policy, dropout: bool, sp_div: int = 1):
        self.p = pol
        self.r = Recipe()
        self.dropout = dropout
        self.sp_div = sp_div
        # weight-gradient bytes per element while a linear's backward runs: the matmul's grad in
        # the compute dtype and, under autocast, its fp32 cast that becomes param.grad
        self.wgrad_bytes = (HALF + F32) if pol.amp else pol.weight

    # -- ops ------------------------------------------------------------------------------
    def t(self, tok: float, nbytes: int, name: str, sq: float = 0.0) -> T:
        return T(tok, sq, nbytes, name)

    def matmul_in(self, x: T, name: str) -> T:
        """Input of a linear/matmul as autograd saves it: a fresh half copy when autocast casts it."""
        if self.p.amp and x.nbytes != HALF:
            x = T(x.tok, x.sq, HALF, name)
        self.r.save(x)
        return x

    def linear(self, x: T, out: float, name: str, saved_name: str, in_features: float | None = None) -> T:
        """``F.linear``/``addmm``: saves the (cast) input; weight copies are counted separately."""
        xin = self.matmul_in(x, saved_name)
        y = T(out, 0.0, self.p.half, name)
        in_features = xin.tok if in_features is None else in_features
        w = in_features * out
        # backward: grad_out, grad_in and the weight gradient alive together
        self.r.transient(f"{name}.backward", T(out, 0, self.p.half), T(xin.tok, 0, self.p.half),
                         const=w * self.wgrad_bytes, own_weights=w)
        self.r.weights += w
        return y

    def layer_norm(self, x: T, name: str) -> T:
        """``F.layer_norm`` (autocast fp32): saves the (fp32) input and fp32 mean/rstd per token."""
        xin = x
        if self.p.amp and x.nbytes != F32:
            xin = T(x.tok, 0, F32, name)
        self.r.save(T(xin.tok, 0, xin.nbytes, name), T(2, 0, F32, name + ".stats"))
        return T(x.tok, 0, F32 if self.p.amp else x.nbytes, name + ".out")

    def rms_norm_hf(self, x: T, name: str) -> T:
        """Hugging Face LlamaRMSNorm (Python ops): ``x.float()`` saved by ``pow``/``mul``; ``rsqrt``
        output (fp32 per token); the normalised tensor cast back to the input dtype, saved by the
        multiply with the weight. Output dtype: weight dtype x input dtype promotion."""
        x32 = x if x.nbytes == F32 else T(x.tok, 0, F32, name)
        self.r.save(T(x32.tok, 0, F32, name), T(1, 0, F32, name + ".stats"))
        normed = T(x.tok, 0, x.nbytes, name)  # fp32 normed.to(input_dtype) is a new tensor either way
        self.r.save(normed)
        return T(x.tok, 0, max(self.p.weight, x.nbytes), name + ".out")

    def drop(self, x: T, p: float, name: str, keep_output: bool = False) -> T:
        """Dropout: a 1-byte mask when p > 0 (CUDA's fused kernel); identity when p == 0."""
        if p <= 0 or not self.dropout:
            if keep_output:
                self.r.save(x)
            return x
        self.r.save(T(x.tok, x.sq, 1, name + ".mask"))
        y = T(x.tok, x.sq, x.nbytes, name)
        if keep_output:
            self.r.save(y)
        return y

    def attention(self, q: T, k: T, v: T, heads: float, kv_heads: float, head_dim: int, impl: str,
                  p_drop: float, softmax_fp32_then_cast: bool) -> T:
        """Scaled dot-product attention; returns the context tensor the output projection consumes.

        eager: ``matmul(q, k^T)`` saves q and k (GQA: the repeated k/v copies), softmax saves its
        fp32 output (autocast runs softmax in fp32), the probabilities cast back to half are saved by
        ``matmul(p, v)`` (or the dropout output and its mask); the ``(b, h, s, d)`` result is copied
        by ``transpose(1, 2).contiguous()`` into the context. ``sdpa`` runs the backend PyTorch's
        CUDA dispatcher picks (``sdpa_backend``).
        """
        half = self.p.half
        if impl == "eager":
            rep = heads / kv_heads
            if rep > 1:  # repeat_kv materialises expanded copies that matmul saves
                k = T(k.tok * rep, 0, k.nbytes, "attn.k_repeated")
                v = T(v.tok * rep, 0, v.nbytes, "attn.v_repeated")
            self.r.save(q, k, v)
            # softmax output as saved: fp32 under autocast, in fp32 training, or when the model asks
            # for dtype=float32 (Llama); else the half type
            sm = F32 if (self.p.amp or half == F32 or softmax_fp32_then_cast) else half
            probs = T(0, heads, sm, "attn.softmax")
            self.r.save(probs)
            if p_drop > 0 and self.dropout:
                self.r.save(T(0, heads, 1, "attn.probs_dropout.mask"))
                pv = T(0, heads, half, "attn.probs")  # dropout output (or its half cast) feeds p @ v
            elif sm != half:
                pv = T(0, heads, half, "attn.probs")  # the half copy p @ v consumes
            else:
                pv = probs
            self.r.save(pv)
            self.r.transient("attn.softmax.backward", T(0, heads, half), T(0, heads, F32))
            return T(heads * head_dim, 0, half, "attn.context")
        backend = "flash" if impl == "flash" else sdpa_backend(half, head_dim, heads != kv_heads)
        if backend == "math":
            # at::_scaled_dot_product_attention_math: computes in fp32 (half inputs are upcast), scales
            # q and k^T by sqrt(scale) (the matmul saves both; GQA expands k and v to all heads first),
            # _safe_softmax saves its fp32 output and p @ v saves p and v (an fp32 copy when upcast or
            # expanded). Its (b, h, s, d) output is copied into the context by transpose().contiguous().
            expand = heads != kv_heads
            vv = v if (not expand and half == F32) else T(heads * head_dim if expand else v.tok, 0, F32,
                                                          "attn.math.v")
            self.r.save(T(heads * head_dim, 0, F32, "attn.math.q_scaled"),
                        T(heads * head_dim, 0, F32, "attn.math.k_scaled"), vv,
                        T(0, heads, F32, "attn.math.softmax"))
            # backward: the gradient of the probabilities and softmax's gradient, both fp32
            self.r.transient("attn.math.backward", T(0, heads, F32), T(0, heads, F32))
            return T(heads * head_dim, 0, half, "attn.context")
        # flash / memory-efficient kernels save q, k, v (flash: k and v with their own heads), the
        # output and an fp32 logsumexp per (head, token). The output is laid out (b, s, h, d), so
        # the context the output projection saves is the same storage.
        out = T(heads * head_dim, 0, half, "attn.sdpa_out")
        self.r.save(q, k, v, out, T(heads, 0, F32, "attn.logsumexp"))
        grads = T(q.tok + k.tok + v.tok + heads * head_dim, 0, half)  # dq, dk, dv and d(out) in flight
        if backend == "flash":
            # kernel scratch: fp32 dq accumulator and softmax_d; GQA expands dk, dv to all heads
            scratch = T(heads * head_dim + heads, 0, F32)
            gqa = T(2 * heads * head_dim if heads != kv_heads else 0, 0, half)
            self.r.transient("attn.flash.backward", grads, scratch, gqa)
        else:
            self.r.transient("attn.efficient.backward", grads, T(heads, 0, F32))
        return out


def sdpa_backend(half: int, head_dim: int, gqa: bool) -> str:
    """The kernel ``F.scaled_dot_product_attention`` runs on an sm80+ GPU without an explicit mask
    (transformers passes ``is_causal`` or no mask for unpadded batches, and ``enable_gqa`` for
    grouped-query attention): flash for fp16/bf16 with head_dim <= 256 and a multiple of 8;
    else memory-efficient attention, which takes no GQA and needs head_dim aligned (4 in fp32, 8
    in half); else the math path (PyTorch's sdp_utils.cpp checks; ``trace`` makes the same choice).
    """
    if half == HALF and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    if not gqa and head_dim % (4 if half == F32 else 8) == 0:
        return "efficient"
    return "math"


# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerKey:
    family: str
    act_impl: str
    precision: str
    attention: str
    dropout: bool
    hidden_dropout: float
    attention_dropout: float
    h: int
    f: int
    q: int
    kv: int
    heads: int
    kv_heads: int
    head_dim: int
    tp: int
    sp: bool
    experts: int
    top_k: int
    pre_norm: bool
    lora: tuple[tuple[str, int, int], ...] = ()
    kv_cache: bool = False   # transformers builds a DynamicCache in training (config.use_cache)


@dataclass(frozen=True)
class LayerCoefs:
    """Saved bytes of one layer: ``tok * b*s + sq * b*s*s_kv`` plus its largest backward transient."""

    tok: float
    sq: float
    parts: tuple[tuple[str, float, float], ...]
    transients: tuple[tuple[str, float, float, float], ...]  # (op, excess per token, per token x key, bytes)
    held: float = 0.0        # bytes per token the model output holds without autograd saving them
    cache: float = 0.0       # bytes per token of the KV cache the model output references (saved or not)
    weights: float = 0.0     # matmul weight elements of the layer (this rank)
    after: tuple[float, ...] = ()  # per transient: weight elements of the linears back-propagated before it

    def bytes(self, n: int, nsq: int) -> int:
        return int(self.tok * n + self.sq * nsq)

    def transient(self, n: int, nsq: int, grad_per_weight: float = 0.0) -> tuple[str, int]:
        """The op whose backward adds the most on top of the whole layer's saved tensors (can be
        negative: the tensors freed by then outweigh the gradients in flight). ``grad_per_weight``:
        gradient bytes per weight element; the gradients of the layer's later linears (computed
        before this op's backward) count at that moment."""
        name, v, _ = self.transient_parts(n, nsq, grad_per_weight)
        return name, v

    def transient_parts(self, n: int, nsq: int, grad_per_weight: float = 0.0) -> tuple[str, int, int]:
        """``transient`` and, of its bytes, those that are gradients of the layer's later linears."""
        best = ("", -(1 << 62), 0)
        after = self.after or (0.0,) * len(self.transients)
        for (name, a, b, c), w in zip(self.transients, after):
            g = int(w * grad_per_weight)
            v = int(a * n + b * nsq + c) + g
            if v > best[1]:
                best = (name, v, g)
        return best


@lru_cache(maxsize=4096)
def layer_coefficients(k: LayerKey) -> LayerCoefs:
    """Build the recipe of one transformer layer (per rank) and reduce it to coefficients."""
    pol = Policy.of(k.precision)
    t = k.tp
    sp_div = t if k.sp else 1  # sequence parallel splits the replicated regions over TP ranks
    B = Builder(pol, k.dropout, sp_div)
    h, f, q, kv = k.h, k.f / t, k.q / t, k.kv / t
    heads, kvh = k.heads / t, max(k.kv_heads / t, 1 if k.kv_heads < t else k.kv_heads / t)
    x = T(h / sp_div, 0, pol.stream, "residual")
    build = {"gpt2": _gpt2_layer, "nanogpt": _gpt2_layer, "bert": _bert_layer,
             "roberta-prenorm": _bert_layer}.get(k.family, _llama_layer)
    build(B, k, x, h, f, q, kv, heads, kvh, sp_div)
    half = pol.half
    for name, r_, cols in k.lora:
        # LoRA (peft): lora_A saves the layer input (shared with the base linear unless cast),
        # lora_B saves the rank-r intermediate; dropout is identity at peft's default p = 0.
        B.r.save(T(r_ / max(1, t if cols else 1), 0, half, f"lora.{name}"))

    tok, sq, parts = B.r.coefficients()
    trans = tuple((name, a + st - tok, b + ss - sq, c) for name, a, b, c, st, ss, _ in B.r.transients)
    wall = B.r.weights
    after = tuple(max(0.0, wall - w) for *_, w in B.r.transients)
    held = sum(t.tok * t.nbytes for i, t in B.r.held.items() if i not in B.r.saved)
    return LayerCoefs(tok, sq, tuple((n, a, b) for n, (a, b) in parts.items()), trans, held, B.r.cache, wall,
                      after)


def _gpt2_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers GPT2Block / nanoGPT Block: pre-LN, fused qkv (c_attn), GELU MLP."""
    pol, half = B.p, B.p.half
    a_in = B.layer_norm(x, "ln_1")
    B.linear(T(h / sp_div, 0, a_in.nbytes, "ln_1.out"), q + 2 * kv, "c_attn", "c_attn.input", h)
    qq, kk, vv = (T(q, 0, half, "attn.qkv"), T(kv, 0, half, "attn.qkv"), T(kv, 0, half, "attn.qkv"))
    if k.attention == "eager":
        # q, k, v are views of the c_attn output: one storage
        qkv_t = T(q + 2 * kv, 0, half, "attn.qkv")
        B.r.save(qkv_t)
        qq = kk = vv = T(0, 0, half, "attn.qkv")
    elif k.attention == "flash" or sdpa_backend(half, k.head_dim, heads != kvh) != "math":
        # the kernel saves q as a view: the whole c_attn output stays alive. With a KV cache
        # (transformers, config.use_cache) k and v are the cache's copies (torch.cat).
        B.r.save(T(q + 2 * kv, 0, half, "attn.qkv"))
        qq = T(0, 0, half, "attn.qkv")
        if k.kv_cache:
            kk, vv = T(kv, 0, half, "attn.k_cache"), T(kv, 0, half, "attn.v_cache")
        else:
            kk = vv = qq
    if k.kv_cache:
        B.r.cache = 2 * kv * half  # the cache's copies of k and v
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=False)
    B.linear(ctx, h, "c_proj", "c_proj.input")
    B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "attn.resid_dropout")
    x2 = T(h / sp_div, 0, pol.stream, "residual")
    m_in = B.layer_norm(x2, "ln_2")
    B.linear(T(h / sp_div, 0, m_in.nbytes, "ln_2.out"), f, "c_fc", "c_fc.input", h)
    act = _gelu(B, k.act_impl, f)
    B.linear(act, h, "mlp.c_proj", "mlp.c_proj.input")
    B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "mlp.resid_dropout")


def _bert_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers BertLayer (post-LN) / XLMRobertaXLLayer (pre-LN): separate q, k, v linears."""
    pol, half = B.p, B.p.half
    if k.pre_norm:
        a_in = B.layer_norm(x, "attention.self_attn_layer_norm")
        src = T(h / sp_div, 0, a_in.nbytes, "attention.ln.out")
    else:
        src = x  # the previous layer's LayerNorm output
    qq = B.linear(src, q, "query", "qkv.input", h)
    kk = B.linear(src, kv, "key", "qkv.input", h)
    vv = B.linear(src, kv, "value", "qkv.input", h)
    qq, kk, vv = T(q, 0, half, "attn.q"), T(kv, 0, half, "attn.k"), T(kv, 0, half, "attn.v")
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=False)
    B.linear(ctx, h, "attention.output.dense", "attention.output.dense.input")
    B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "attention.output.dropout")
    if k.pre_norm:
        x2 = T(h / sp_div, 0, pol.stream, "residual")
        m_in = B.layer_norm(x2, "LayerNorm")
        src2 = T(h / sp_div, 0, m_in.nbytes, "LayerNorm.out")
    else:
        sum1 = T(h / sp_div, 0, pol.stream, "attention.output.LayerNorm")
        ln1 = B.layer_norm(sum1, "attention.output.LayerNorm")
        src2 = T(h / sp_div, 0, ln1.nbytes, "attention.output.LayerNorm.out")
    B.linear(src2, f, "intermediate.dense", "intermediate.dense.input", h)
    act = _gelu(B, k.act_impl, f)
    B.linear(act, h, "output.dense", "output.dense.input")
    B.drop(T(h / sp_div, 0, half, "resid"), k.hidden_dropout, "output.dropout")
    if not k.pre_norm:
        # its output is the next layer's input, saved by the next layer's q/k/v (or the head)
        B.layer_norm(T(h / sp_div, 0, pol.stream, "output.LayerNorm"), "output.LayerNorm")


def _llama_layer(B: Builder, k: LayerKey, x: T, h: int, f: float, q: float, kv: float, heads: float, kvh: float, sp_div: int) -> None:
    """transformers LlamaDecoderLayer / MixtralDecoderLayer: RMSNorm, rotary, GQA, SwiGLU (MoE)."""
    pol, half = B.p, B.p.half
    a_in = B.rms_norm_hf(x, "input_layernorm")
    src = T(h / sp_div, 0, a_in.nbytes, "input_layernorm.out")
    if not pol.amp:
        B.r.save(src)  # shared input of q/k/v (no per-call casts without autocast)
    for name, width in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        B.linear(src, width, name, f"{name}.input", h)
    # rotary: q*cos + rotate_half(q)*sin makes new q and k tensors; cos/sin are shared per model
    qq, kk, vv = T(q, 0, half, "attn.q_rot"), T(kv, 0, half, "attn.k_rot"), T(kv, 0, half, "attn.v")
    if k.kv_cache and pol.amp:
        # Under autocast cos/sin are fp32 (the residual dtype), so the rotated k is fp32; the
        # cache is created in k's dtype and torch.cat promotes v into it, so the cache holds
        # fp32 copies of k and v, which attention does not save (it saves its half casts). They
        # live as long as the model output does.
        B.r.hold(T(kv, 0, F32, "kv_cache.k"), T(kv, 0, F32, "kv_cache.v"))
    if k.kv_cache:
        B.r.cache = 2 * kv * (F32 if pol.amp else half)  # the cache's copies of k and v
    ctx = B.attention(qq, kk, vv, heads, kvh, k.head_dim, k.attention, k.attention_dropout,
                      softmax_fp32_then_cast=True)
    B.linear(ctx, h, "o_proj", "o_proj.input")
    x2 = T(h / sp_div, 0, pol.stream, "residual")
    m_in = B.rms_norm_hf(x2, "post_attention_layernorm")
    src2 = T(h / sp_div, 0, m_in.nbytes, "post_attention_layernorm.out")
    if not pol.amp:
        B.r.save(src2)
    if k.experts:
        _moe(B, src2, h, f, k.experts, k.top_k)
    else:
        _swiglu(B, f, h, src2, "mlp", fused_gate_up=False)


def _gelu(B: Builder, impl: str, f: float) -> T:
    """The MLP activation on the ``c_fc``/``intermediate`` output (half under autocast).

    ``gelu`` / ``gelu_pytorch_tanh`` (fused ``F.gelu``): saves its input, returns the input dtype.
    ``gelu_new`` (transformers NewGELUActivation, Python ops): under autocast ``pow`` runs in fp32 and
    saves an fp32 copy of the input; ``tanh`` saves its fp32 output; the final product saves
    ``0.5 * x`` (half) and ``1 + tanh`` (fp32) and returns fp32, which the next linear casts again.
    Without autocast the same ops save x, tanh, 0.5x and 1 + tanh in the working dtype.
    """
    half = B.p.half
    if impl == "gelu_new":
        wide = F32 if B.p.amp else half
        B.r.save(T(f, 0, wide, "mlp.act.pow_input"), T(f, 0, wide, "mlp.act.tanh"),
                 T(f, 0, half, "mlp.act.half_x"), T(f, 0, wide, "mlp.act.one_plus_tanh"))
        return T(f, 0, wide, "mlp.act.out")
    B.r.save(T(f, 0, half, "mlp.act.input"))
    return T(f, 0, half, "mlp.act.out")


def _moe(B: Builder, src: T, h: float, f: float, experts: int, top_k: int) -> None:
    """A Mixtral-style sparse MoE block as transformers >= 5 runs it (``grouped_mm`` experts, its
    default): the router (``F.linear``, fp32 softmax over experts, top-k, renormalised weights),
    then the tokens gathered in expert order (S = top_k rows per token), one ``_grouped_mm`` for
    gate and up together, SwiGLU, one for down, the routing weights (fp32) multiplied in, the
    rows put back in token order and summed.

    ``_grouped_mm`` has no autocast rule and transformers casts its input to the weights' dtype,
    so under autocast (fp32 weights) the experts compute and save fp32 tensors, and no half copies
    of the expert weights are made. The routing weights are fp32, so the weighted output and its
    gradients are fp32 too.
    """
    wd = B.p.weight
    k = top_k
    # router: saves its (cast) input, the fp32 softmax, top-k indices, the sum and the pre-division
    # weights of the in-place renormalisation
    B.linear(src, experts, "mlp.gate", "router.input", h)
    B.r.save(T(experts, 0, F32, "router.softmax"), T(k, 0, 8, "router.topk_index"),
             T(k + 1, 0, F32, "router.topk_weights"))
    # gather: the token rows in expert order, their routing weights, and the int64 permutations
    # (sorted expert ids, perm // top_k, inverse permutation) the index backward needs
    xin = T(k * h, 0, wd, "experts.input")
    B.r.save(xin, T(k, 0, F32, "experts.routing_weights"), T(3 * k, 0, 8, "experts.indices"))
    # gate_up: saves the gathered rows; its (S, 2f) output is saved by silu (gate) and the
    # product (up) as views; the product is saved by down; down's output by the routing multiply
    grad_w = wd  # the weight gradient comes in the parameter's dtype and layout (stolen as .grad)
    B.r.transient("experts.gate_up.backward", T(2 * k * f, 0, wd), T(k * h, 0, wd),
                  const=experts * 2 * f * h * grad_w, own_weights=experts * 2 * f * h)
    B.r.weights += experts * 2 * f * h
    B.r.save(T(2 * k * f, 0, wd, "experts.gate_up_out"), T(k * f, 0, wd, "experts.silu_out"))
    # SwiGLU backward (the product, saved by down, is freed by then): down's input gradient and the
    # product's two gradients
    B.r.transient("experts.act.backward", T(3 * k * f, 0, wd))
    B.r.save(T(k * f, 0, wd, "experts.act_product"))
    B.r.transient("experts.down.backward", T(k * h, 0, wd), T(k * f, 0, wd),
                  const=experts * f * h * grad_w, own_weights=experts * f * h)
    B.r.weights += experts * f * h
    B.r.save(T(k * h, 0, wd, "experts.down_out"))
    # combine backward: index_put of the gradient into zeros, both products' gradients (fp32)
    # and the cast back to the experts' dtype
    B.r.transient("experts.combine.backward", T(3 * k * h, 0, F32), T(k * h, 0, wd))


def _swiglu(B: Builder, f: float, h: float, src: T, name: str, fused_gate_up: bool) -> None:
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``: gate and up save their (cast) input; ``silu``
    saves the gate output; the product saves silu's output and the up output; down saves the
    product."""
    half = B.p.half
    if fused_gate_up:
        B.matmul_in(src, f"{name}.gate_up.input")
    else:
        B.linear(src, f, f"{name}.gate_proj", f"{name}.gate_proj.input", h)
        B.linear(src, f, f"{name}.up_proj", f"{name}.up_proj.input", h)
    B.r.save(T(f, 0, half, f"{name}.gate_out"), T(f, 0, half, f"{name}.silu_out"),
             T(f, 0, half, f"{name}.up_out"))
    prod = T(f, 0, half, f"{name}.act_product")
    B.linear(prod, h, f"{name}.down_proj", f"{name}.down_proj.input")
