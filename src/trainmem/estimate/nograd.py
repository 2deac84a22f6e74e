"""A checkpointed hand-written layer's first forward, tensor by tensor (the allocator replay's
``reserved.layer_forward._checkpointed``).

Under full recomputation the first forward of a layer saves nothing (reentrant checkpointing runs it
under ``torch.no_grad()``, torch 2.13 ``utils/checkpoint.py`` ``CheckpointFunction.forward`` L248-276;
non-reentrant packs no tensor, ``_checkpoint_without_reentrant_generator``), so each tensor lives only
as long as the Python code holds it. Which tensor is freed after which op decides which cached blocks
the next ones can reuse, hence how many segments the allocator opens: the replay used to make all of
the layer's saved tensors at once and free them together (12 segments where trace opens 5 on
Llama-2-7B LoRA, Answer.AI's FSDP1 rows +6 to +13 % on the peak reserved memory).

This module writes the forward of transformers' ``LlamaDecoderLayer`` (and peft's ``lora.Linear``
around its targets) as a list of temporaries: ``sizes`` (bytes per token of each, in its dtype) and
``events`` ("t": the next temporary made; "fK": the K-th freed; "o": the layer's output made, which
the replay allocates as what the checkpoint keeps, and after which every temporary still alive is
freed). Sources (transformers 5.24.0, the same sequence at 4.37.2's ``LlamaSdpaAttention``):
``models/llama/modeling_llama.py`` ``LlamaRMSNorm.forward`` L62-67, ``apply_rotary_pos_emb``
L127-149 with ``rotate_half`` L119-123, ``LlamaMLP.forward`` L163-165, ``LlamaAttention.forward``
L233-271, ``LlamaDecoderLayer.forward`` L286-316; ``integrations/sdpa_attention.py``
``sdpa_attention_forward`` L182-197 (the fused kernels write (b, s, heads, d): the final
``transpose(1, 2).contiguous()`` copies nothing); peft 0.21.2 ``tuners/lora/layer.py``
``Linear.forward`` L1074-1117. Tensors of one element per token or row (the norm's variance, the
fused attention's logsumexp) are left out: a few KiB to 1 MiB, in the small pool.

A bitsandbytes 4-bit base linear (``Linear4bit``, ``NoGradLayer.quant``) also makes its weight
dequantized, whose size is the weight's, not per token: each temporary has ``sizes`` bytes per token
plus ``consts`` bytes (0 for all but those). Attention's (b, heads, s, s) scores (eager attention,
``eager`` and ``_bert_eager``; SDPA's math kernel, ``math_sdpa``) have ``sq`` bytes per token x key
instead, the math kernel's (s, s) causal mask ``pair`` bytes per position pair (``make_sq``); the
replay allocates ``sizes * tokens + consts + sq * tokens x keys + pair * s^2``
(``reserved.parts._nograd_bytes``). BERT's post-LN ``BertLayer`` is written the same way (``bert_layer``).

Under autocast (``NoGradLayer.amp``, full fine-tuning) a "c" event stands for autocast's half copy
of the next linear's weight, which the replay makes where it keeps the copies linear by linear
(``reserved.layer_forward._nograd_forward``)."""

from __future__ import annotations

from dataclasses import dataclass, field

F32 = 4


@dataclass
class NoGradSeq:
    """The sequence being written: ``sizes`` bytes per token, ``events`` as the module says."""

    sizes: list = field(default_factory=list)
    events: list = field(default_factory=list)
    consts: list = field(default_factory=list)   # bytes of each beside its per-token ones
    # the temporaries that are an ``aten.mm``'s output (each linear's, in call order) and the fused
    # SDPA kernel's output: what torchtitan's per-op policy may keep (``op_kept``)
    mm: list = field(default_factory=list)
    sdpa: list = field(default_factory=list)
    # the first linear's output, an ``aten.mm``'s or a biased linear's ``addmm``'s: where the forward
    # thread's cuBLAS workspace is made (``LayerCoefs.nograd_mm0``); -1 before any linear
    mm0: int = -1
    # bytes of each per token x key (b * s * s: the math SDPA kernel's and eager attention's scores) and
    # per position pair (s * s: the math kernel's causal mask), beside ``sizes`` (0 for the others; ``make_sq``)
    sq: list = field(default_factory=list)
    pair: list = field(default_factory=list)
    # indices of the temporaries made only where the micro-batch holds more than one sequence (a
    # reshape's copy of a (b, heads, s, d) transposed view, ``_bert_eager``; at b = 1 it is a view)
    batched: list = field(default_factory=list)

    def op_kept(self) -> list:
        """Indices of the temporaries torchtitan's per-op selective checkpointing keeps from the
        layer's forward (as ``layers.op_checkpoint_kept`` counts them): the odd ``aten.mm`` calls
        (1st, 3rd, ...) and the fused SDPA kernel's output, in the order they are made. torchtitan
        v0.2.2 ``_op_sac_save_list`` (torchtitan/models/llama3/infra/parallelize.py L36-51) and
        ``_apply_op_sac``'s policy (torchtitan/distributed/activation_checkpoint.py L98-128)."""
        return sorted(set(self.mm[0::2] + self.sdpa))

    def make(self, nbytes_tok: float, nbytes: float = 0.0) -> int:
        """A new temporary of ``nbytes_tok`` bytes per token plus ``nbytes``; returns its index."""
        self.sizes.append(float(nbytes_tok))
        self.consts.append(float(nbytes))
        self.sq.append(0.0)
        self.pair.append(0.0)
        self.events.append("t")
        return len(self.sizes) - 1

    def make_sq(self, nbytes_sq: float, nbytes_pair: float = 0.0) -> int:
        """A new temporary of ``nbytes_sq`` bytes per token x key ((b, heads, s, s) scores) plus
        ``nbytes_pair`` per position pair ((s, s) masks; ``sq``, ``pair``); returns its index."""
        i = self.make(0.0)
        self.sq[i], self.pair[i] = float(nbytes_sq), float(nbytes_pair)
        return i

    def cast(self) -> None:
        """autocast's half copy of the next linear's weight (``reserved.layer_forward._nograd_forward`` makes it
        where the replay keeps the copies, ``_linear_casts``)."""
        self.events.append("c")

    def free(self, *idx: int | None) -> None:
        for i in idx:
            if i is not None:
                self.events.append(f"f{i}")


@dataclass(frozen=True)
class NoGradLayer:
    """What the sequence of one Llama-shaped layer needs (per rank, elements per token): widths,
    dtypes (bytes per element: the residual stream's, the linears' outputs', the weights'), LoRA
    (each target's rank, its dropout, the adapters' dtype)."""

    h: float
    q: float
    kv: float
    f: float
    stream: int          # the residual stream (the layer's input and output)
    half: int            # a linear's output (no autocast: the weights' dtype)
    weight: int          # the norms' weights
    lora: dict = field(default_factory=dict)   # target module name -> rank
    lora_dropout: float = 0.0
    adapter: int = 0     # the adapters' dtype, bytes (peft ``_cast_input_dtype`` casts x to it)
    repeat_kv: bool = False  # grouped keys and values copied to the query's heads before SDPA
    # bitsandbytes 4-bit base linears: bytes per element of the dequantized weight (the quant state's
    # dtype) and of its cast to the compute dtype (0: none), LayerKey.quant; ``nested``: double
    # quantization (the fp32 absmax dequantized first)
    quant: tuple = (0, 0)
    nested: bool = False
    amp: bool = False    # under autocast: fp32 weights and stream, linears and SDPA in ``half``
    code: str = "transformers"  # whose layer: transformers' ``LlamaDecoderLayer`` or "torchtitan"'s ``TransformerBlock``
    # SDPA's math kernel (PyTorch >= 2.5, upcasting half inputs to fp32; ``math_sdpa``) with the
    # query's heads per rank, else 0 (a fused kernel); ``gqa``: grouped keys expanded inside it (enable_gqa)
    math_heads: float = 0.0
    gqa: bool = False
    # transformers' eager attention (``eager``) with the query's heads per rank, else 0; ``bf16_copy``:
    # softmax(dtype=float32) copies a bf16 input to fp32 first (an fp16 one runs half_to_float)
    eager_heads: float = 0.0
    bf16_copy: bool = False
    # the modules whose linear has a bias (``LayerKey.addmm``: Qwen2's q/k/v): ``at::linear`` runs them as
    # ``addmm``, not ``aten.mm``, which torchtitan's per-op policy does not count (``NoGradSeq.mm``)
    addmm: tuple = ()


def _rank(L: NoGradLayer, name: str) -> int:
    return next((r for t, r in L.lora.items() if name == t or name.endswith("." + t)), 0)


def rms_norm(S: NoGradSeq, L: NoGradLayer, x_bytes: int) -> int:
    """``LlamaRMSNorm.forward`` (L62-67) on an (b, s, h) input of ``x_bytes``: ``x.to(fp32)`` (a copy
    unless fp32), ``pow(2)`` (fp32, freed once ``mean`` has reduced it), ``x * rsqrt(...)`` (fp32; the
    cast input freed as the name is rebound), ``.to(input_dtype)`` (a copy unless fp32) and
    ``weight * ...`` (the promoted dtype: the output); the fp32 product and the cast are freed when
    the norm returns. Returns the output's index."""
    h = L.h
    a = S.make(h * F32) if x_bytes != F32 else None    # hidden_states.to(torch.float32)
    p = S.make(h * F32)                                 # .pow(2), reduced by .mean(-1)
    S.free(p)
    m = S.make(h * F32)                                 # hidden_states * torch.rsqrt(variance + eps)
    S.free(a)
    c = S.make(h * x_bytes) if x_bytes != F32 else None  # .to(input_dtype)
    out = S.make(h * max(L.weight, x_bytes))            # self.weight * ...
    S.free(c, m)
    return out


def _mm_out(S: NoGradSeq, L: NoGradLayer, name: str, res: int) -> None:
    """Marks linear ``name``'s output ``res`` as an ``aten.mm``'s (``NoGradSeq.mm``, what torchtitan's per-op
    policy counts) unless the linear has a bias (``L.addmm``): ``at::linear`` on a 3-D input with a bias runs
    ``addmm`` on the folded input (torch 2.13 ``aten/src/ATen/native/Linear.cpp`` ``linear``:
    ``_flatten_nd_linear``), not on torchtitan v0.2.2's ``_op_sac_save_list`` (as
    ``layers.op_checkpoint_saved`` counts the recipe's). The first linear's output, either way, is
    ``S.mm0``: ``addmm`` takes the cuBLAS handle as ``mm`` does (torch 2.13
    ``aten/src/ATen/native/cuda/Blas.cpp`` ``addmm_out_cuda_impl``, both ops), and its workspace comes
    with it (``reserved.layer_forward._first_mm_workspace``)."""
    if S.mm0 < 0:
        S.mm0 = res
    if not any(b == name or b.endswith("." + name) for b in L.addmm):
        S.mm.append(res)


def linear(S: NoGradSeq, L: NoGradLayer, name: str, x_tok: float, out: float, x_bytes: int = 0) -> int:
    """A linear on an input of ``x_tok`` elements per token in the linear's dtype, ``out`` wide. A
    LoRA target is peft's ``Linear.forward`` (L1088-1111): ``result = base_layer(x)``; ``x`` cast
    to the adapter's dtype (a copy where it differs, a local until the forward returns);
    ``dropout(x)``: ``native_dropout``'s bool mask (made first, CUDA ``dropout_cuda``, and dropped
    at once: ``at::dropout`` keeps the output only) and its output, freed when ``lora_A`` returns;
    ``lora_A``'s (rank) output, freed when ``lora_B`` returns; ``lora_B``'s output, ``* scaling``,
    ``result + ...`` (promoted), each freeing the one before; ``result.to(torch_result_dtype)`` (a
    copy only where the sum was promoted). A 4-bit base layer dequantizes its weight first
    (``dequantized``) and has peft's ``bnb.Linear4bit`` around it (``lora_4bit``). Returns the
    output's index. Under autocast (``L.amp``; no LoRA there) ``at::linear``'s autocast wrapper casts
    its arguments in order (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``): the input, a copy
    freed as the wrapper returns where its dtype (``x_bytes``) is not the half one, then the weight
    (the "c" event: autocast's cached copy), then the output in half."""
    if L.amp:
        xc = S.make(x_tok * L.half) if x_bytes and x_bytes != L.half else None  # the input cast
        S.cast()                                        # the weight's half copy (cached)
        res = S.make(out * L.half)
        _mm_out(S, L, name, res)
        S.free(xc)
        return res
    dq = dequantized(S, L, x_tok * out)
    res = S.make(out * L.half)                          # result = self.base_layer(x)
    _mm_out(S, L, name, res)
    S.free(dq)                                          # freed when MatMul4Bit.forward returns
    rank = _rank(L, name)
    if not rank:
        return res
    ad = L.adapter or L.half
    if L.quant[0]:
        return lora_4bit(S, L, rank, x_tok, out, res)
    xc = S.make(x_tok * ad) if ad != L.half else None   # self._cast_input_dtype(x, lora_A.weight.dtype)
    s = _adapter(S, L, rank, x_tok, out)                # lora_B(lora_A(dropout(x))) * scaling
    total = S.make(out * max(ad, L.half))               # result + ...
    S.free(s, res)
    if max(ad, L.half) != L.half:
        cast = S.make(out * L.half)                     # result.to(torch_result_dtype)
        S.free(total)
        total = cast
    S.free(xc)
    return total


def _adapter(S: NoGradSeq, L: NoGradLayer, rank: int, x_tok: float, out: float) -> int:
    """``lora_B(lora_A(dropout(x))) * scaling`` in the adapters' dtype on the (cast) input:
    ``native_dropout``'s bool mask (made first and dropped at once) and its output, freed when
    ``lora_A`` returns; ``lora_A``'s (rank) output, freed when ``lora_B`` returns; ``lora_B``'s
    output, freed once ``* scaling`` is made. Returns the scaled output's index."""
    ad = L.adapter or L.half
    dropped = None
    if L.lora_dropout > 0:
        S.free(S.make(x_tok * 1))                       # the dropout mask (bool), discarded
        dropped = S.make(x_tok * ad)                    # dropout(x)
    a = S.make(rank * ad)                               # lora_A(...)
    S.free(dropped)
    b = S.make(out * ad)                                # lora_B(...)
    S.free(a)
    s = S.make(out * ad)                                # ... * scaling
    S.free(b)
    return s


def lora_4bit(S: NoGradSeq, L: NoGradLayer, rank: int, x_tok: float, out: float, res: int) -> int:
    """peft's LoRA layer over a bitsandbytes 4-bit base (peft 0.21.2 ``tuners/lora/bnb.py``
    ``Linear4bit.forward`` L513-565), after ``result = self.base_layer(x)`` (``res``):
    ``result = result.clone()`` (L533, "we need to defensively clone here": the base output freed
    as the name is rebound); outside autocast ``x`` cast to the adapters' dtype (L546, a copy where
    it differs, a local until the forward returns); ``output = lora_B(lora_A(dropout(x))) *
    scaling`` (L549, ``_adapter``) and, where the dtypes differ, ``output.to(expected_dtype)``
    (L551, the first freed as ``output`` is rebound); ``result = result + output`` (L552) in the
    base output's dtype, the clone freed, ``output`` a local until the forward returns. Returns the
    output's index."""
    ad = L.adapter or L.half
    clone = S.make(out * L.half)                        # result.clone()
    S.free(res)
    xc = S.make(x_tok * ad) if ad != L.half else None   # self._cast_input_dtype(x, lora_A.weight.dtype)
    s = _adapter(S, L, rank, x_tok, out)
    if ad != L.half:
        cast = S.make(out * L.half)                     # output.to(expected_dtype)
        S.free(s)
        s = cast
    total = S.make(out * L.half)                        # result + output
    S.free(clone, s, xc)
    return total


def dequantized(S: NoGradSeq, L: NoGradLayer, w: float) -> int | None:
    """A bitsandbytes 4-bit base weight of ``w`` elements in ``Linear4bit.forward`` -> ``matmul_4bit``
    -> ``MatMul4Bit.forward`` (bitsandbytes 0.43.3 ``nn/modules.py`` L451-481, ``autograd/_functions.py``
    L559-579 and L493-520): ``F.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)``
    (L509). ``dequantize_4bit`` (``functional.py`` L1291-1425): with double quantization the fp32
    absmax, one per 64-element block (``dequantize_blockwise``, L1346-1350), then ``out`` (L1353, the
    quant state's dtype), the absmax freed as it returns; ``.to(A.dtype)`` a copy only where the
    dtypes differ, the uncast one freed as ``.to`` returns (a temporary of the expression). What is
    left lives until ``F.linear`` has made the output (freed by the caller, ``linear``); under
    no_grad nothing is saved (``ctx.tensors`` dies with the unattached node). Weight-sized: all in
    ``consts``. Returns the index of the weight the matmul reads, None for a 16-bit base."""
    dq_bytes, cast_bytes = L.quant
    if not dq_bytes:
        return None
    absmax = S.make(0.0, w / 64 * F32) if L.nested else None  # fp32 per 64-element block
    dq = S.make(0.0, w * dq_bytes)                      # torch.empty(quant_state.shape, quant_state.dtype)
    S.free(absmax)
    if cast_bytes:
        cast = S.make(0.0, w * cast_bytes)              # .to(A.dtype)
        S.free(dq)
        dq = cast
    return dq


def rotary(S: NoGradSeq, L: NoGradLayer, width: float) -> int:
    """One of ``apply_rotary_pos_emb``'s (L147-148) ``(q * cos) + (rotate_half(q) * sin)``, left to
    right: ``q * cos``; ``rotate_half``'s ``-x2`` (half the width) and ``torch.cat`` (the negation
    freed as ``cat`` returns); ``* sin`` (the cat freed); the sum (both products freed). Under
    autocast ``cos`` and ``sin`` are in the stream's dtype (fp32: ``LlamaRotaryEmbedding.forward``
    returns ``cos.to(dtype=x.dtype)`` of the fp32 hidden states, L110-116), so the products and the sum
    are promoted to fp32 (``mul`` and ``add`` are not autocast ops) and the rotated q and k are fp32."""
    pd = max(L.half, L.stream) if L.amp else L.half    # the products' dtype
    qc = S.make(width * pd)
    neg = S.make(width / 2 * L.half)
    cat = S.make(width * L.half)
    S.free(neg)
    qs = S.make(width * pd)
    S.free(cat)
    out = S.make(width * pd)
    S.free(qc, qs)
    return out


def titan_rms_norm(S: NoGradSeq, L: NoGradLayer, x_bytes: int) -> int:
    """torchtitan's ``RMSNorm.forward`` (torchtrain ``models/llama/model.py`` L63 and L76-77 at
    pytorch/torchtitan@83c879f18^): ``self._norm(x.float())``: the fp32 copy (none where ``x`` is
    fp32), ``x.pow(2)`` (fp32, freed once ``mean`` has reduced it), ``x * torch.rsqrt(...)`` (fp32),
    the copy freed as ``_norm`` returns (its argument); ``.type_as(x)`` (a copy unless fp32), the fp32
    product freed as it returns; ``output * self.weight`` (the promoted dtype: the output), the cast
    freed when the norm returns. Unlike transformers' norm the fp32 product is gone before the
    output is made. Returns the output's index."""
    h = L.h
    a = S.make(h * F32) if x_bytes != F32 else None    # x.float()
    p = S.make(h * F32)                                 # x.pow(2), reduced by .mean(-1, keepdim=True)
    S.free(p)
    m = S.make(h * F32)                                 # x * torch.rsqrt(...)
    S.free(a)
    c = S.make(h * x_bytes) if x_bytes != F32 else None  # .type_as(x)
    if c is not None:
        S.free(m)
    out = S.make(h * max(L.weight, x_bytes))            # output * self.weight
    S.free(c if c is not None else m)
    return out


def titan_rotary(S: NoGradSeq, L: NoGradLayer, q: int, k: int) -> tuple[int, int]:
    """torchtitan's ``apply_rotary_emb`` (torchtrain ``models/llama/model.py`` L148-153 at
    pytorch/torchtitan@83c879f18^, the same body in torchtitan's ``models/llama3/model/model.py``
    through 2025) on the linears' outputs ``q``, ``k``: ``xq.float()`` and ``xk.float()`` (fp32
    copies, kept by their complex views ``xq_``, ``xk_`` until it returns; none where the linears'
    dtype is fp32), the complex64 products ``xq_ * freqs_cis`` and ``xk_ * freqs_cis`` (as many
    bytes as the fp32 copies; ``view_as_real(...).flatten(3)`` views them), ``.type_as(xq)`` and
    ``.type_as(xk)`` (the linears' dtype: copies unless fp32, where the products are returned), the
    copies and products freed as it returns and the linears' outputs when ``xq, xk`` are rebound
    (``Attention.forward`` L250). Returns the rotated q's and k's indices."""
    widths = (L.q, L.kv)
    copies = [S.make(w * F32) if L.half != F32 else None for w in widths]  # xq.float(), xk.float()
    prods = [S.make(w * F32) for w in widths]           # xq_ * freqs_cis, xk_ * freqs_cis (complex64)
    if L.half == F32:                                   # .type_as: the products themselves
        S.free(q, k)
        return prods[0], prods[1]
    outs = [S.make(w * L.half) for w in widths]         # xq_out.type_as(xq), xk_out.type_as(xk)
    S.free(*copies, *prods, q, k)
    return outs[0], outs[1]


def _rotated(S: NoGradSeq, L: NoGradLayer, q: int, k: int) -> tuple[int, int]:
    """q and k rotated by the layer's code (``rotary`` twice, transformers', or ``titan_rotary``);
    the unrotated ones freed."""
    if L.code == "torchtitan":
        return titan_rotary(S, L, q, k)
    qe = rotary(S, L, L.q)
    ke = rotary(S, L, L.kv)
    S.free(q, k)
    return qe, ke


def _sdpa_casts(S: NoGradSeq, L: NoGradLayer, rb: int) -> list:
    """Under autocast SDPA is on the lower-precision list: its autocast wrapper casts the query and
    the keys (rotated in ``rb`` bytes, fp32: ``rotary``) to half, in argument order, freed as it
    returns; the values are the linear's half output, not copied."""
    if not L.amp or rb == L.half:
        return []
    width = L.q if L.repeat_kv else L.kv
    return [S.make(L.q * L.half), S.make(width * L.half)]   # query.to(half), key.to(half)


def llama_layer(L: NoGradLayer) -> NoGradSeq:
    """``LlamaDecoderLayer.forward`` (L286-316) under no_grad, the layer's input alive throughout (the
    checkpoint keeps it). The norm's output lives until ``self_attn`` returns; q, k, v (L244-246)
    until the attention returns (the rotated q and k replace q and k once both are made, L249);
    SDPA's output until ``o_proj`` has read it; the residual sum until the MLP's output is added;
    ``LlamaMLP`` (L164): ``act_fn(gate_proj(x))`` (the gate output freed when ``silu`` returns),
    ``up_proj(x)``, their product (both freed), ``down_proj`` (the product freed). Grouped keys and
    values (``repeat_kv``: the releases that copy them, ``quantities.model_facts.release_attention_call``) are
    copied to the query's heads inside ``sdpa_attention_forward`` (L126-127 at 5.24; 4.48-4.53 the
    same) and freed when it returns, the rotated ones still held by the caller (before 4.48
    ``LlamaSdpaAttention`` rebinds ``key_states``, freeing the rotated keys a little earlier).

    torchtitan's ``TransformerBlock.forward`` (``code`` "torchtitan"; torchtrain
    ``models/llama/model.py`` L420-422 at pytorch/torchtitan@83c879f18^: ``h = x +
    self.attention(self.attention_norm(x), freqs_cis)``, ``out = h +
    self.feed_forward(self.ffn_norm(h))``) has the same lifetimes around its own norm
    (``titan_rms_norm``) and rotation (``titan_rotary``); ``Attention.forward`` L240-271: ``wq``,
    ``wk``, ``wv`` (L244), the rotation (L250), ``repeat_kv`` (L253-258, copies where the key heads
    are fewer; the rotated keys and the values freed as ``xk``, ``xv`` are rebound to them,
    L261-262, the copies held until the attention returns), SDPA (L265; the fused kernels write
    (b, s, heads, d), so ``transpose(1, 2).contiguous()`` copies nothing), ``wo`` (L271);
    ``FeedForward.forward`` L310 ``w2(F.silu(w1(x)) * w3(x))`` is transformers' MLP."""
    S = NoGradSeq()
    norm = titan_rms_norm if L.code == "torchtitan" else rms_norm
    nb = max(L.weight, L.stream)                        # the norms' outputs' dtype
    n1 = norm(S, L, L.stream)
    q = linear(S, L, "q_proj", L.h, L.q, nb)
    k = linear(S, L, "k_proj", L.h, L.kv, nb)
    v = linear(S, L, "v_proj", L.h, L.kv, nb)
    qe, ke = _rotated(S, L, q, k)
    rb = max(L.half, L.stream) if L.amp else L.half     # the rotated keys' dtype (``rotary``)
    rk = S.make(L.q * rb) if L.repeat_kv else None      # repeat_kv(key), repeat_kv(value): q-wide copies,
    rv = S.make(L.q * L.half) if L.repeat_kv else None  # locals of sdpa_attention_forward (L126-127)
    if L.code == "torchtitan" and L.repeat_kv:          # xk = keys.transpose(1, 2), xv = values...
        S.free(ke, v)
        ke, v, rk, rv = rk, rv, None, None              # held until Attention.forward returns
    casts = _sdpa_casts(S, L, rb) if not L.eager_heads else []
    if L.eager_heads:
        ao = eager(S, L)                                # eager_attention_forward (its weights kept by ``_``)
    elif L.math_heads:
        ao = math_sdpa(S, L)                            # the math kernel, then .transpose(1, 2).contiguous()
    else:
        ao = S.make(L.q * L.half)                       # scaled_dot_product_attention (fused kernel)
        S.sdpa.append(ao)
    S.free(*casts, rk, rv)
    o = linear(S, L, "o_proj", L.q, L.h, L.half)
    S.free(ao, qe, ke, v, n1)                           # o_proj returns; the attention returns
    h1 = S.make(L.h * L.stream)                         # residual + hidden_states
    S.free(o)
    n2 = norm(S, L, L.stream)
    g = linear(S, L, "gate_proj", L.h, L.f, nb)
    act = S.make(L.f * L.half)                          # act_fn(...): silu, out of place
    S.free(g)
    up = linear(S, L, "up_proj", L.h, L.f, nb)
    prod = S.make(L.f * L.half)                         # ... * up_proj(x)
    S.free(act, up)
    down = linear(S, L, "down_proj", L.f, L.h, L.half)
    S.free(prod, n2)
    S.events.append("o")                                # residual + hidden_states: the output
    del h1, down                                        # (freed after it: the replay frees what is alive)
    return S


def math_sdpa(S: NoGradSeq, L: NoGradLayer) -> int:
    """``F.scaled_dot_product_attention`` on SDPA's math kernel under no_grad, then transformers'
    ``attn_output.transpose(1, 2).contiguous()`` (integrations/sdpa_attention.py
    ``sdpa_attention_forward``, a copy: the math kernel writes (b, heads, s, d)), the kernel's output
    freed as the name is rebound. torch 2.13 ``aten/src/ATen/native/transformers/attention.cpp``
    ``_scaled_dot_product_attention_math`` (PyTorch >= 2.5: half inputs computed in fp32), in the
    order its ops ran (dispatch log of the kernel on CPU, bf16 and fp32; trace of Llama-3.2-1B b1
    s1024 bf16, 2048-wide: 8, 2, 2, 8, (mask), 8, 8, 8, 128, -8, 128, -128, 64, 8, 4, -8, then the
    rest freed as the kernel returns): ``query_.to(kFloat)``, ``key.to``, ``value.to`` (fp32 copies
    of half inputs, none in fp32); ``query_acc * scaling_factor`` (fp32); the causal mask
    (``ones({L, S}, kBool).tril()``, the bool ones freed, ``convert_boolean_attn_mask``'s fp32
    ``where``, the tril freed: per position pair); with ``enable_gqa``
    (``pre_process_group_query_attention_input``) the keys and the values expanded to the query's
    heads (``repeat_interleave``: fp32 copies); ``key.transpose(-2, -1) * scaling_factor`` (fp32,
    freed once ``matmul`` has read it); the scores (``bmm``, (b, heads, s, s) fp32); the mask added
    in place; ``_safe_softmax`` (fp32, the scores freed as ``attn`` is rebound); ``attn.to(origin)``
    (the second returned tensor, a half copy made first, dropped by ``scaled_dot_product_attention``);
    ``matmul(attn, value)`` (fp32) and ``.to(origin)`` (half, the fp32 one freed). Everything else
    is freed as the kernel returns. ``_safe_softmax``'s own temporaries run below the dispatcher
    (trace.cuda_kernels) and are left out, as the scalars. Returns the contiguous copy's index."""
    d, hd = L.half, L.math_heads
    kv = L.q if L.repeat_kv else L.kv                   # the key width SDPA is given (repeat_kv's copies)
    up = d != F32
    qa = S.make(L.q * F32) if up else None              # query_.to(at::kFloat)
    ka = S.make(kv * F32) if up else None               # key.to(at::kFloat)
    va = S.make(kv * F32) if up else None               # value.to(at::kFloat)
    qs = S.make(L.q * F32)                              # query_acc * scaling_factor
    ones = S.make_sq(0.0, 1)                            # at::ones_symint({L, S}, kBool)
    tril = S.make_sq(0.0, 1)                            # .tril()
    S.free(ones)
    mask = S.make_sq(0.0, F32)                          # convert_boolean_attn_mask: where(...) in fp32
    S.free(tril)
    ke = S.make(L.q * F32) if L.gqa else None           # enable_gqa: keys, values at the query's heads
    ve = S.make(L.q * F32) if L.gqa else None
    ks = S.make(L.q * F32)                              # key.transpose(-2, -1) * scaling_factor
    sc = S.make_sq(hd * F32)                            # at::matmul: the scores (b, heads, s, s)
    S.free(ks)
    sm = S.make_sq(hd * F32)                            # at::_safe_softmax(attn, -1)
    S.free(sc)
    ac = S.make_sq(hd * d) if up else None              # attn.to(origin_dtype) (returned, dropped)
    pv = S.make(L.q * F32)                              # at::matmul(attn, value)
    out = S.make(L.q * d) if up else pv                 # .to(origin_dtype)
    if up:
        S.free(pv)
    S.free(sm, ke, ve, qs, mask, va, ka, qa, ac)        # the kernel returns
    ctg = S.make(L.q * L.half)                          # attn_output.transpose(1, 2).contiguous()
    S.free(out)
    return ctg


def eager(S: NoGradSeq, L: NoGradLayer) -> int:
    """transformers 5.24 ``models/llama/modeling_llama.py`` ``eager_attention_forward`` (L180-202; Mistral's
    and Qwen2's the same) under no_grad, without dropout (``p=0``: ``at::dropout`` returns its input),
    after ``repeat_kv``'s copies (L190-191, made by the caller, ``llama_layer``, where the key heads are
    fewer): ``matmul(query, key^T)`` (A, (b, heads, s, s) in the half dtype) ``* scaling`` (B; A freed),
    ``+ attention_mask`` (C; B freed; the mask, built once per model forward, is the stream's dtype,
    the half one outside autocast); ``softmax(C, dim=-1, dtype=float32)``: a bf16 input first copied
    to fp32 (F, torch 2.13 ``aten/src/ATen/native/SoftMax.cpp`` ``softmax``: ``input_.toType(dtype)``;
    an fp16 one runs ``half_to_float``), the fp32 output (D; F freed), ``.to(query.dtype)`` (E, a copy
    unless fp32; D freed), C freed as ``attn_weights`` is rebound; ``matmul(attn_weights, value)``
    (q-wide, half) and ``transpose(1, 2).contiguous()`` (a copy; the first freed). E is returned as
    ``attn_weights`` through ``LlamaAttention.forward`` (L258-271) to ``LlamaDecoderLayer.forward``'s
    ``hidden_states, _ = self.self_attn(...)`` (L299): the local ``_`` holds it until the layer
    returns, so it is alive at the output ("o") and freed after it. Trace, Llama-3.2-1B b1 s1024 bf16
    eager, full recomputation: 4, 4 (repeat_kv), 64, 64, -64, 64, -64, 128, 128, -128, 64, -128,
    -64, 4, 4, -4, the 64 MiB weights freed after the layer's output. Under autocast (``L.amp``)
    ``matmul`` is on the lower-precision list (``autocast_mode.cpp`` ``cached_cast``, in argument
    order, freed as it returns): the fp32 rotated query and the repeated fp32 keys cast to half before
    the scores, the weights cast before ``matmul(attn_weights, value)``; the mask is fp32 (the
    stream's), so C is fp32, softmax copies nothing, and ``.to(query.dtype)`` (fp32) is D itself, which
    ``_`` then holds. Trace, the same at bf16-amp: 8, 4 (repeat_kv), 4, 4, 64, -4, -4, 64, -64, 128,
    -64, 128, -128, 64, 4, -64, 4, -4, -8, -4; the 128 MiB softmax output freed after the layer's
    output. Returns the copy's index."""
    d, hd = L.half, L.eager_heads
    qc = S.make(L.q * d) if L.amp else None             # autocast's matmul: query.to(half) (rotated in fp32),
    kc = S.make(L.q * d) if L.amp else None             # key_states.to(half), freed as it returns
    a = S.make_sq(hd * d)                               # torch.matmul(query, key_states.transpose(2, 3))
    S.free(kc, qc)
    b = S.make_sq(hd * d)                               # ... * scaling
    S.free(a)
    c = S.make_sq(hd * max(d, L.stream))                # attn_weights + attention_mask
    S.free(b)
    f = S.make_sq(hd * F32) if L.bf16_copy else None    # softmax's input_.toType(float32)
    sm = S.make_sq(hd * F32)                            # softmax(..., dtype=torch.float32)
    S.free(f)
    w = sm
    if not L.amp and d != F32:
        w = S.make_sq(hd * d)                           # .to(query.dtype)
        S.free(sm)
    S.free(c)                                           # attn_weights rebound
    wc = S.make_sq(hd * d) if L.amp else None           # autocast's matmul: attn_weights.to(half)
    o = S.make(L.q * d)                                 # torch.matmul(attn_weights, value_states)
    S.free(wc)
    ctg = S.make(L.q * d)                               # attn_output.transpose(1, 2).contiguous()
    S.free(o)
    return ctg                                          # (w: held by the decoder layer's ``_``)


def _bert_dropout(S: NoGradSeq, L: NoGradLayer, x: int, width: float, p: float) -> int:
    """``nn.Dropout`` on a ``width``-wide tensor ``x`` of the linears' dtype under no_grad, ``p`` > 0:
    ``native_dropout``'s output and its bool mask, the mask dropped at once (``at::dropout`` keeps the
    output), the input freed as the caller rebinds its name. Returns the output's index."""
    if p <= 0:
        return x
    out = S.make(width * L.half)
    S.free(S.make(width * 1))                           # the mask (bool), discarded
    S.free(x)
    return out


def _bert_eager(S: NoGradSeq, L: NoGradLayer, heads: float, p_attn: float) -> tuple[int, int]:
    """transformers 5.24 ``models/bert/modeling_bert.py`` ``eager_attention_forward`` (L112-137) on
    q, k, v of (b, heads, s, d) views of the linears' (b, s, h) outputs: ``torch.matmul(query,
    key.transpose(2, 3))`` reshapes both to 3-d batches, copies of the non-contiguous views (aten
    ``LinearAlgebra.cpp`` ``_matmul_impl``: ``expand(...).reshape(...)``), freed as it returns; the
    scores (b, heads, s, s); ``* scaling`` (the scores freed as the name is rebound); ``softmax``;
    ``dropout`` (``_bert_dropout``, scores-wide); ``torch.matmul(attn_weights, value)`` (the value's
    copy, the (b*heads, s, d) output, the copy freed), ``transpose(1, 2).contiguous()`` (a copy, the
    matmul's output freed). Sizes of the scores are per token x key (``NoGradSeq.sq``). The dropped
    probabilities are returned as ``attn_weights`` and held by ``BertLayer.forward``'s ``_`` (L386) to
    the layer's end. The three reshapes copy only where the micro-batch holds more than one sequence
    (``NoGradSeq.batched``): the (b, heads, s, d) view of a (b, s, h) output has strides (s h, d, h, 1),
    which fold into (b heads, s, d) without a copy only at b = 1 (``TensorShape.cpp`` ``reshape`` ->
    ``computeStride``; trace, BERT-base b1 s2048 pure bf16 eager per-op recompute: ``query``'s output,
    the workspace, ``key``'s and ``value``'s, then the 96 MiB scores). Under autocast (``L.amp``) softmax is on autocast's fp32 list
    (``aten/src/ATen/autocast_mode.cpp``: its input cast to fp32, a copy freed as the wrapper returns,
    and an fp32 output), so the dropout's output is fp32 too and the second ``matmul`` casts it back to
    half (a copy, freed as that wrapper returns). Trace, BERT-base b4 s512 bf16-amp eager per-op
    recompute: the scores 24 MiB, scaled 24, the fp32 cast 48, softmax 48, the cast freed, dropout 48
    and its 12 MiB mask, the half cast 24, the value's copy, the bmm output, the copy and the cast freed.
    Returns (the attention output's index, the probabilities')."""
    qc, kc = S.make(L.q * L.half), S.make(L.kv * L.half)   # query, key.transpose(2, 3) reshaped: copies
    S.batched += [qc, kc]
    sc = S.make_sq(heads * L.half)                      # bmm: (b*heads, s, s)
    S.free(kc, qc)
    scaled = S.make_sq(heads * L.half)                  # ... * scaling
    S.free(sc)
    up = S.make_sq(heads * F32) if L.amp else None      # autocast: softmax's fp32 input cast
    pd = F32 if L.amp else L.half
    probs = S.make_sq(heads * pd)                       # softmax
    S.free(up, scaled)
    if p_attn > 0:
        dropped = S.make_sq(heads * pd)                 # dropout: the output, then its bool mask
        S.free(S.make_sq(heads * 1))
        S.free(probs)
        probs = dropped
    pc = S.make_sq(heads * L.half) if L.amp else None   # autocast: matmul's half cast of the probabilities
    vc = S.make(L.kv * L.half)                          # value reshaped: a copy
    S.batched.append(vc)
    bo = S.make(L.q * L.half)                           # bmm: (b*heads, s, d)
    S.free(vc, pc)
    ao = S.make(L.q * L.half)                           # transpose(1, 2).contiguous()
    S.free(bo)
    return ao, probs


def bert_layer(L: NoGradLayer, heads: float, eager: bool, p_hidden: float, p_attn: float) -> NoGradSeq:
    """transformers 5.24 ``BertLayer.forward`` (``models/bert/modeling_bert.py`` L377-414) under
    no_grad in one dtype (no autocast, no adapters), the layer's input alive throughout (the checkpoint
    keeps it). ``BertSelfAttention.forward`` (L166-205): ``query``, ``key``, ``value`` (L177-179,
    linears with bias: one output each), then eager attention (``_bert_eager``) or SDPA's fused kernel
    (``integrations/sdpa_attention.py`` L182-197: its (b, s, heads, d) output, ``transpose(1, 2)
    .contiguous()`` copying nothing), q, k, v freed as it returns. ``BertSelfOutput.forward`` (L290-294):
    ``dense``, ``dropout`` (``_bert_dropout``), ``hidden_states + input_tensor``, ``LayerNorm`` (the
    sum freed as it returns), the dropped output freed as it returns, the attention output as
    ``BertAttention.forward`` (L323) rebinds it. ``BertIntermediate`` (L336-339): ``dense``, the GELU
    (``dense``'s output freed). ``BertOutput`` (L349-353) as ``BertSelfOutput``; its LayerNorm's output
    is the layer's ("o"), after which ``BertOutput``'s sum and dropout output, the GELU's output
    (``feed_forward_chunk``'s local, L416-419), eager attention's probabilities and the attention
    output are freed (the replay frees what is alive after the output). Under autocast (``L.amp``: fp32
    weights, stream and LayerNorms) each linear casts an fp32 input to half first (``linear``: q, k, v
    the layer's input, ``intermediate.dense`` the LayerNorm's output), the dense outputs and the GELU are
    half, the residual sums fp32 (half + fp32 promotes), and eager attention's softmax runs in fp32
    (``_bert_eager``)."""
    S = NoGradSeq()
    hd = L.half
    q = linear(S, L, "query", L.h, L.q, L.stream)       # (under autocast each casts the fp32 input)
    k = linear(S, L, "key", L.h, L.kv, L.stream)
    v = linear(S, L, "value", L.h, L.kv, L.stream)
    if eager:
        ao, probs = _bert_eager(S, L, heads, p_attn)
    else:
        ao, probs = S.make(L.q * hd), None              # scaled_dot_product_attention (fused kernel)
        S.sdpa.append(ao)
    S.free(q, k, v)
    d1 = _bert_dropout(S, L, linear(S, L, "attention.output.dense", L.q, L.h, hd), L.h, p_hidden)
    s1 = S.make(L.h * L.stream)                         # hidden_states + input_tensor
    a1 = S.make(L.h * max(L.weight, L.stream))          # LayerNorm: the attention output
    S.free(s1, d1, ao)
    i1 = linear(S, L, "intermediate.dense", L.h, L.f, max(L.weight, L.stream))  # (the LayerNorm's output)
    g = S.make(L.f * hd)                                # intermediate_act_fn (GELU), out of place
    S.free(i1)
    d2 = _bert_dropout(S, L, linear(S, L, "output.dense", L.f, L.h, hd), L.h, p_hidden)
    S.make(L.h * L.stream)                              # hidden_states + input_tensor
    S.events.append("o")                                # LayerNorm: the layer's output
    del d2, g, probs, a1                                # (freed after it: the replay frees what is alive)
    return S


def _gelu_new(S: NoGradSeq, L: NoGradLayer, x: int, width: float) -> int:
    """transformers 5.24 ``activations.py`` ``NewGELUActivation.forward`` (L65-66) under no_grad in one
    dtype on ``x`` (``width`` wide): ``0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
    (input + 0.044715 * torch.pow(input, 3.0))))``, Python evaluating left to right, each op out of
    place: ``0.5 * input``, then ``pow``, ``* 0.044715``, ``input +``, ``* sqrt(2/pi)``, ``tanh``,
    ``1.0 +``, each of the chain's freed once the next has read it, and the product, after which
    ``0.5 * input`` and ``1.0 + tanh`` go (trace, GPT-2 b8 s256 bf16: ``mul``, ``pow``, ``mul``, ``add``,
    ``mul``, ``tanh``, ``add``, ``mul`` of 12 MiB each). Under autocast (``L.amp``) ``pow`` is on the
    fp32 list (``aten/src/ATen/autocast_mode.cpp``): it casts its half input to an fp32 copy, freed as it
    returns, and every later op runs in fp32 (their operands promoted), ``0.5 * input`` staying half.
    ``x`` is the caller's to free. Returns the product's index."""
    d = width * (F32 if L.amp else L.half)              # (under autocast fp32 from ``pow`` on)
    half_x = S.make(width * L.half)                     # 0.5 * input
    copy = S.make(width * F32) if L.amp else None       # autocast: pow's fp32 copy of its input
    prev = S.make(d)                                    # torch.pow(input, 3.0)
    S.free(copy)
    for _op in range(4):                                # * 0.044715, input +, * sqrt(2/pi), tanh
        nxt = S.make(d)
        S.free(prev)
        prev = nxt
    one = S.make(d)                                     # 1.0 + tanh
    S.free(prev)
    out = S.make(d)                                     # 0.5 * input * (...)
    S.free(half_x, one)
    return out


def _gpt2_eager(S: NoGradSeq, L: NoGradLayer, heads: float, p_attn: float) -> tuple[int, int]:
    """transformers 5.24 ``models/gpt2/modeling_gpt2.py`` ``eager_attention_forward`` (L55-73) under
    no_grad on q, k, v of (b, heads, s, d) views of ``c_attn``'s output: ``torch.matmul(query,
    key.transpose(-1, -2))`` copies both strided views as it reshapes them (``_matmul_impl``), freed as
    it returns; the scores; ``* scaling`` (the scores freed); ``+ attention_mask`` (the causal mask in
    the model's dtype, ``L.weight``: promoted to fp32 under autocast); ``softmax`` (on autocast's fp32
    list); ``.type(value.dtype)`` (a copy where that is not the half dtype); ``dropout``
    (``_bert_dropout``, scores-wide, its mask one byte per element); ``torch.matmul(attn_weights,
    value)`` (the value's copy freed as it returns); ``GPT2Attention.forward``'s ``reshape(...)
    .contiguous()`` of the transposed output (a copy, the matmul's output freed). The dropped
    probabilities are returned as ``attn_weights`` and held by ``GPT2Block.forward``'s ``_`` to the
    block's end. Trace, GPT-2 b8 s256 bf16-amp: ``clone`` 3, 3, ``bmm`` 12, ``mul`` 12, ``add`` 24,
    ``_softmax`` 24, ``_to_copy`` 12, ``native_dropout`` 12 and 6, ``clone`` 3, ``bmm`` 3, ``clone`` 3 MiB.
    Returns (the attention output's index, the probabilities')."""
    hd = L.half
    qc, kc = S.make(L.q * hd), S.make(L.kv * hd)        # query, key.transpose(-1, -2) reshaped: copies
    sc = S.make_sq(heads * hd)                          # bmm: (b*heads, s, s)
    S.free(kc, qc)
    scaled = S.make_sq(heads * hd)                      # ... * scaling
    S.free(sc)
    wide = max(hd, L.weight)                            # + attention_mask (the model's dtype): promoted
    masked = S.make_sq(heads * wide)
    S.free(scaled)
    probs = S.make_sq(heads * (F32 if L.amp else wide))  # softmax
    S.free(masked)
    if (F32 if L.amp else wide) != hd:                  # .type(value.dtype)
        typed = S.make_sq(heads * hd)
        S.free(probs)
        probs = typed
    if p_attn > 0:
        dropped = S.make_sq(heads * hd)                 # dropout: the output, then its bool mask
        S.free(S.make_sq(heads * 1))
        S.free(probs)
        probs = dropped
    vc = S.make(L.kv * hd)                              # value reshaped: a copy
    bo = S.make(L.q * hd)                               # bmm: (b*heads, s, d)
    S.free(vc)
    ao = S.make(L.q * hd)                               # transpose(1, 2).reshape(...).contiguous()
    S.free(bo)
    return ao, probs


def gpt2_block(L: NoGradLayer, p_hidden: float, gelu_new: bool, eager_heads: float = 0.0,
               p_attn: float = 0.0) -> NoGradSeq:
    """transformers 5.24 ``GPT2Block.forward`` (``models/gpt2/modeling_gpt2.py`` L276-318) under no_grad
    (no adapters, cache; q, k, v from one ``c_attn``; a fused SDPA kernel, or eager attention with
    ``eager_heads`` heads, ``_gpt2_eager``, its dropout ``p_attn``), the
    layer's input alive throughout (the checkpoint keeps it). ``ln_1`` (its output bound to
    ``hidden_states``); ``GPT2Attention.forward`` (L146-228): ``c_attn`` (``Conv1D``: ``torch.addmm``,
    ``pytorch_utils.py`` L117-121; q, k, v are views of its output, locals until the attention returns),
    SDPA's fused kernel (its (b, s, heads, d) output: ``reshape(...).contiguous()`` copies nothing),
    ``c_proj`` (the kernel's output freed as ``attn_output`` is rebound), ``resid_dropout``
    (``_bert_dropout``: its output, the mask dropped, ``c_proj``'s output freed), then q, k, v's
    ``c_attn`` output freed as it returns; ``attn_output + residual`` (``ln_1``'s output freed as
    ``hidden_states`` is rebound); ``ln_2``; ``GPT2MLP.forward`` (L241-245): ``c_fc``, the activation
    (``_gelu_new``, or the fused ``F.gelu``), ``c_fc``'s output freed as ``hidden_states`` is rebound,
    ``c_proj`` (the activation's output freed), ``dropout``; ``residual + feed_forward_hidden_states``
    is the layer's output ("o"), after which ``ln_2``'s output, the attention branch's sum
    (``residual``) and both dropout outputs (``attn_output``, ``feed_forward_hidden_states``) go as
    the block returns (the replay frees what is alive after the output). Trace, GPT-2 b8 s256 pure bf16,
    FSDP1, full recomputation: that sequence of 3, 9, 3, 3, 3 and 12 MiB blocks. Under autocast
    (``L.amp``: fp32 weights and stream) each ``Conv1D``'s ``addmm`` casts an fp32 input to a half copy
    freed as it returns and takes its weight's cached half copy (``linear``: ``c_attn`` and ``c_fc`` read
    the norms' fp32 outputs, the MLP's ``c_proj`` ``gelu_new``'s fp32 product), the norms and the residual
    adds are fp32, the branches half."""
    S = NoGradSeq()
    hd = L.half
    ln1 = S.make(L.h * L.stream)                        # ln_1
    qkv = linear(S, L, "c_attn", L.h, L.q + 2 * L.kv, L.stream)
    if eager_heads:                                     # eager attention (its probabilities held to the end)
        ao, probs = _gpt2_eager(S, L, eager_heads, p_attn)
    else:
        ao, probs = S.make(L.q * hd), None              # scaled_dot_product_attention (fused kernel)
        S.sdpa.append(ao)
    proj = linear(S, L, "attn.c_proj", L.q, L.h, hd)
    S.free(ao)
    d1 = _bert_dropout(S, L, proj, L.h, p_hidden)       # resid_dropout
    S.free(qkv)                                         # GPT2Attention.forward returns
    s1 = S.make(L.h * L.stream)                         # attn_output + residual
    S.free(ln1)
    ln2 = S.make(L.h * L.stream)                        # ln_2
    fc = linear(S, L, "c_fc", L.h, L.f, L.stream)
    act = _gelu_new(S, L, fc, L.f) if gelu_new else S.make(L.f * hd)
    S.free(fc)
    mp = linear(S, L, "mlp.c_proj", L.f, L.h, F32 if (L.amp and gelu_new) else hd)
    S.free(act)
    d2 = _bert_dropout(S, L, mp, L.h, p_hidden)         # mlp.dropout
    S.events.append("o")                                # residual + feed_forward_hidden_states
    del d1, s1, ln2, d2, probs                          # (freed after it: the replay frees what is alive)
    return S
