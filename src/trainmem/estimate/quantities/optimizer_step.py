"""The optimizer step's temporaries: foreach groups and the loops that linger, the step's copies,
Adafactor's per-tensor loop, LOMO's update in backward, GaLore's step, optimizer-in-backward."""
from __future__ import annotations

from typing import Any

from ...spec.galore import LOWRANK_OPTIMIZERS
from ...spec.model import ModelSpec
from ...spec.training import BNB_OPTIMIZERS, LOMO_OPTIMIZERS, TORCHAO_OPTIMIZERS, TrainingSpec, galore_target
from .. import torchao_optim
from ..galore import GTensor, step_order, step_replay
from ..states import States, parameter_order
from .model_facts import block_of
from .zero_partition import deepspeed_zero
from .zero_step import deepspeed_group_elems, deepspeed_step_grad


def step_temporaries(t: TrainingSpec, st: States, m: ModelSpec | None = None) -> int:
    """Bytes ``optimizer.step()`` allocates and frees again (steady state, states already exist).

    From torch/optim/adam.py (torch 2.13; AdamW = Adam with decoupled weight decay, in place):
      * for-loop (``_single_tensor_adam``): ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
        .add_(eps)``: the square root and the quotient of one tensor coexist -> 2 x the largest
        parameter (in the state dtype);
      * foreach (``_multi_tensor_adam``): ``exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)``
        then in-place div/add/addcdiv -> one state-sized tensor per parameter, the whole group at once;
      * fused (``_fused_adamw_``): none.
    Measured on the CPU with ``trainmem.measure.LiveBytes`` (tests/test_optim_transients.py).
    Under optimizer-in-backward each parameter has its own optimizer: foreach is a group of one
    (1 x the parameter), for-loop 2 x, fused none; the largest parameter sets the peak.
    """
    k = step_copies(t)
    if deepspeed_zero(t) and not t.offload_optimizer and st.trainable:
        # DeepSpeed hands the optimizer one flat fp32 partition per group: a per-tensor loop or a
        # foreach step sees that one tensor (``deepspeed_group_elems``); fused steps make none
        flat = block_of(t, deepspeed_group_elems(t, st) * 4)
        return deepspeed_step_grad(t, st, m) + (foreach_groups(t) * flat if k is None else k * flat)
    if t.optimizer == "adafactor" and not t.offload_optimizer:
        return _adafactor_temporaries(t, st, k)
    if t.torchao_block:
        # torchao's low-bit AdamW: one compiled graph per tensor, its buffers freed when it returns
        # (estimate.torchao_optim.step_events; the largest tensor's set the peak)
        return st.torchao_step
    if k is None:
        return foreach_groups(t) * st.foreach_group
    if k and step_lingers(t) and st.trainables:
        return loop_pair_bytes(st, k)
    return k * block_of(t, st.largest_param)


#: per-tensor loops that keep the last temporary of a tensor in a local until the next tensor's
#: replaces it (``loop_pair_bytes``)
LINGERING_LOOPS = ("adam", "adamw", "adagrad", "rmsprop", "schedule-free-adamw", "schedule-free-radam")


def step_lingers(t: TrainingSpec) -> bool:
    """Whether the step is such a loop over whole tensors (``LINGERING_LOOPS``, for-loop, one
    optimizer for every parameter, the states not sharded)."""
    return (t.optimizer in LINGERING_LOOPS and t.impl == "for-loop" and not t.grads_freed_in_backward
            and not t.offload_optimizer and t.zero_stage == 0 and t.fsdp is None and t.gemini is None)


def loop_pair_bytes(st: States, copies: int) -> int:
    """A per-tensor loop whose expression makes ``copies`` temporaries of the tensor's size and
    keeps the last in a local variable: torch 2.13 ``_single_tensor_adam`` (adam.py L544
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: the square root and the
    quotient, 2), ``_single_tensor_adagrad`` (adagrad.py L425 ``std = state_sum.sqrt().add_(eps)``,
    1), ``_single_tensor_rmsprop`` (rmsprop.py L325 ``avg = square_avg.sqrt()``, 1), schedule_free's
    ``denom = exp_avg_sq.div(bias_correction2).sqrt_().add_(eps)`` (1). The previous tensor's
    temporary is freed only when the name is rebound, after the next tensor's are made, so the
    peak is the largest ``previous + copies x this`` over neighbours in parameter order (a
    state-sized block each; a GPT-2's token embedding and then its position embedding; a Llama
    whose MLP matrices are its largest: gate_proj, then up_proj), measured with LiveBytes
    (tests/test_hf_optimizers.py)."""
    order = [st.trainables[j][3] for j in parameter_order(st.trainables)]
    sizes = [sts[0] for sts in order if sts]
    return max([copies * x for x in sizes[:1]] + [a + copies * b for a, b in zip(sizes, sizes[1:])])


def foreach_groups(t: TrainingSpec) -> int:
    """State-sized temporaries per tensor a foreach step holds at once, for the whole group. Adam,
    RMSprop and the schedule-free optimizers: one (``torch._foreach_sqrt(exp_avg_sqs)``, rmsprop.py
    L448 ``avg = torch._foreach_sqrt(square_avgs)``, schedule_free ``denom = torch._foreach_div(exp_avg_sq,
    bias_correction2)``, the update then in place: ``_foreach_div_(grad, denom)``). Adagrad: two
    (torch 2.13 ``adagrad.py`` ``_multi_tensor_adagrad`` L530-540: ``std = torch._foreach_sqrt(state_sums)``
    and, without weight decay or maximize, ``numerator = torch._foreach_mul(device_grads, minus_clr)``
    in the gradient's dtype, the parameter's, both alive at ``_foreach_addcdiv_``). Adam and AdamW before
    PyTorch 2.1: two (``exp_avg_sq_sqrt`` and ``denom = torch._foreach_add(exp_avg_sq_sqrt, eps)``, torch
    2.0 ``adam.py`` / ``adamw.py`` ``_multi_tensor_adam(w)``; ``spec.releases.foreach_adam_denom_copy``)."""
    if t.optimizer in ("adam", "adamw") and t.foreach_adam_denom_copy:
        return 2
    return 2 if t.optimizer == "adagrad" else 1


def step_copies(t: TrainingSpec) -> int | None:
    """Temporaries per tensor of an optimizer step that loops over tensors (None: a foreach step
    makes one per tensor for the whole group at once; 0: none), as ``step_temporaries`` counts them."""
    if t.optimizer in LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS:
        return 0
    if t.optimizer == "adafactor" and not t.offload_optimizer:
        return 2 if (t.weight_bytes == 4 or t.fp32_master) else 4
    return _copies_per_tensor(t, t.grads_freed_in_backward)


def adafactor_loop(t: TrainingSpec, st: States) -> tuple:
    """What each trainable tensor of ``States.trainables`` (by index) allocates in transformers'
    ``Adafactor.step``, for the reserved replay (``reserved.optimizer._adafactor_step``): (one fp32 tensor of its
    size, its fp32 copies of a half gradient and weight (``grad.float()``, ``p.float()``; 0 for fp32),
    the row and the column vector of a factored tensor's ``update.mean(dim=-1)`` / ``(dim=-2)`` and
    ``_approx_sq_grad``'s ``r_factor`` / ``c_factor`` (fp32, the sizes of its two states; 0 for a vector)),
    each the block of its request. () where the optimizer is not transformers' Adafactor on one device
    over whole tensors (sharded or offloaded states keep ``_adafactor_temporaries``' count)."""
    if (t.optimizer != "adafactor" or t.offload_optimizer or t.zero_stage or t.fsdp is not None or t.tp > 1
            or t.gemini is not None or t.grads_freed_in_backward
            or len(st.trainable_elems) != len(st.trainables)):
        return ()
    half = not (t.weight_bytes == 4 or t.fp32_master)            # bf16/fp16 weights stepped as they are
    out = []
    for (_w, _k, _g, sts, _m), n in zip(st.trainables, st.trainable_elems):
        f = int(block_of(t, n * 4))                               # (shape,) fp32
        row, col = (sts[0], sts[1]) if len(sts) == 2 else (0, 0)  # factored: (lead, rows) and (lead, cols) fp32
        out.append((f, f if half else 0, row, col))
    return tuple(out)


def tp_grad_redistributions(m: ModelSpec, t: TrainingSpec) -> tuple[int, ...]:
    """Bytes of each redistribution of a replicated gradient in a foreach Adam / AdamW step under
    PyTorch's tensor parallelism (``states._replicated_grad``: an untied token embedding's ``.grad`` is
    the whole table, ``Replicate``, while its weight and states are ``Shard(0)``), for the reserved
    replay (``reserved.optimizer._redistributed_grads``): every foreach op that reads the gradients
    beside the states redistributes it to the states' placement, ``Replicate`` -> ``Shard(0)`` being a
    clone of this rank's chunk (torch 2.13 ``distributed/tensor/placement_types.py`` L262-268
    ``_select_split_tensor``), in the gradient's dtype, freed when the op returns:
    ``torch._foreach_lerp_(device_exp_avgs, device_grads, ...)`` one, ``torch._foreach_addcmul_(
    device_exp_avg_sqs, device_grads, device_grads, ...)`` two at once (``optim/adam.py``
    ``_multi_tensor_adam`` L704-725; trace shows the three 125 MiB clones of a (32000, 2048) fp32 table
    over 2 ranks before ``_foreach_sqrt``). One entry per such gradient: its chunk's bytes; () elsewhere
    (other optimizers and implementations: not checked against trace)."""
    from ..states import replicated_grad_chunks
    if t.optimizer not in ("adam", "adamw") or t.impl != "foreach" or t.offload_optimizer:
        return ()
    return replicated_grad_chunks(m, t)


def _adafactor_temporaries(t: TrainingSpec, st: States, copies: int) -> int:
    """transformers' Adafactor (``optimization.py``, ``Adafactor.step``) is a loop over tensors in
    fp32 (there is no foreach version): ``update = grad**2 + eps`` and the factored approximation
    that replaces it, then ``-update * lr``, leave two fp32 tensors of the parameter's size alive at
    once; a bf16/fp16 parameter adds its fp32 copy (``p.float()``) and its gradient's
    (``grad.float()``). The largest parameter sets the peak (2x or 4x its fp32 size, as trace of
    the real optimizer shows: tests/test_optim_transients.py; ``copies``: ``step_copies``). On one
    device over whole tensors (``adafactor_loop``) the previous tensor's ``update`` is freed only when
    the name is rebound, after this tensor's ``grad**2`` and ``+ eps`` exist (L1258; the copies of a
    half gradient and weight come before them), so the peak is the largest ``previous + copies x this``
    over neighbours in parameter order, as ``loop_pair_bytes`` for Adam's loop: a Llama whose MLP
    matrices are its largest tensors holds gate_proj's update beside up_proj's two (fp32) or four (half)
    temporaries (trace, 2 layers, hidden 1024, MLP 8192, vocab 8000, b1 s64: 32 MiB above ``copies``
    x the largest)."""
    loop = adafactor_loop(t, st)
    if loop:
        f = [loop[j][0] for j in parameter_order(st.trainables)]  # each tensor's fp32 block, in step order
        return max([copies * f[0]] + [a + copies * b for a, b in zip(f, f[1:])])
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes
    elems = st.largest_param // sb
    return copies * block_of(t, elems * 4)


def lomo_temporaries(t: TrainingSpec, shape: tuple[int, ...]) -> int:
    """Peak bytes one parameter's update adds inside lomo_optim's hook (``fuse_update``: lomo.py
    L96-140, adalomo.py L143-205), above its gradient: ``grad_fp32 = p.grad.to(torch.float32)`` (a
    copy of a half gradient, which ``p.grad = None`` then frees; an fp32 gradient is ``grad_fp32``
    itself, kept alive by it) and ``p_fp32 = p.data.to(torch.float32)`` (a copy of half weights; the
    weight itself when fp32). Lomo then updates in place. AdaLomo also makes ``update = grad_fp32**2 +
    eps`` (two fp32 tensors of the parameter's size at once), then, that sum still bound to ``update``,
    the factored ``torch.mul(r_factor, c_factor)`` beside its row and column factors, and at the end
    ``p_fp32`` beside the update. Measured on lomo_optim 0.1.1 with LiveBytes (tests/test_lomo.py)."""
    n = 1
    for d in shape:
        n *= d
    half = t.weight_bytes != 4
    g32 = block_of(t, n * 4) if half else 0          # grad_fp32 (half: a copy; fp32: the gradient itself)
    p32 = block_of(t, n * 4) if half else 0          # p_fp32
    after = g32 - block_of(t, n * t.weight_bytes) if half else 0   # p.grad = None: a half gradient freed
    if t.optimizer == "lomo":
        return max(g32, after + p32)                 # the copy beside the gradient; then p_fp32 for it
    f = block_of(t, n * 4)                           # one fp32 tensor of the parameter's size
    factors = block_of(t, shape[0] * 4) + block_of(t, shape[1] * 4) if len(shape) > 1 else 0
    return max(after + 2 * f + factors, after + f + p32)


def lomo_update_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """LOMO / AdaLomo (``oib_update_bytes``): a parameter's tensor hook runs before its gradient is
    accumulated, and updates the parameters whose gradient was accumulated since the previous hook (its
    neighbour, the next in registration order, whose backward ran just before), so that gradient, the
    hook's own parameter's incoming gradient and the update's temporaries (``lomo_temporaries``) exist
    together; after ``loss.backward()``, ``fused_backward`` calls the hook once more for the last ones
    (the input embeddings). Returns the largest such amount among the hooks of the tensors updated while
    activations are alive, and among all."""
    ps = [p for p in m.parameter_tensors() if p.role != "unused"]
    w = t.weight_bytes

    def upd(q: Any) -> int:
        return int(block_of(t, q.numel * w)) + lomo_temporaries(t, q.shape)
    mid = [int(block_of(t, p.numel * w)) + upd(q) for p, q in zip(ps, ps[1:])]
    return max(mid + [0]), max(mid + [upd(p) for p in ps if p.role == "embedding"] + [upd(ps[0])])


def _galore_fields(m: ModelSpec, t: TrainingSpec, st: States, oib: bool) -> dict[str, Any]:
    """``step_temp`` (and GaLore's ``step_events``): a layerwise GaLore steps inside backward (none)."""
    if t.optimizer not in LOWRANK_OPTIMIZERS:
        return {"step_temp": step_temporaries(t, st, m)}
    if oib:
        return {"step_temp": 0}
    o, tensors = t.galore_options(), step_order([x for _, x in _galore_tensors(m, t)])
    steps = {svd: step_replay(tensors, t.optimizer, t.weight_bytes, o["rank"], o["proj_type"], svd,
                              lambda b: int(block_of(t, b))) for svd in (True, False)}
    # the peak: the higher of the two (galore_step_bytes); the replay's first step updates the projectors
    # (as every run's does), the second is a steady one
    return {"step_temp": max(peak for peak, _ in steps.values()), "step_events": steps[False][1],
            "step_events_first": steps[True][1]}


def _galore_tensors(m: ModelSpec, t: TrainingSpec) -> list[tuple[bool, GTensor]]:
    """The trainable tensors in ``model.parameters()`` order, each (input embedding?, shape and
    GaLore target or not)."""
    return [(p.role == "embedding", GTensor(p.shape, galore_target(t, p))) for p in m.parameter_tensors()
            if p.role != "unused"]


def _galore_peak(t: TrainingSpec, tensors: list[GTensor], layerwise: bool) -> tuple[int, tuple]:
    """``galore.step_replay`` at a steady step and at a projector-update step (every ``update_proj_gap``
    steps, the first included), allocator-rounded: the higher peak of the two, and its events."""
    o = t.galore_options()
    return max((step_replay(tensors, t.optimizer, t.weight_bytes, o["rank"], o["proj_type"], svd,
                            lambda b: int(block_of(t, b)), layerwise) for svd in (False, True)),
               key=lambda pe: pe[0])


def galore_step_bytes(m: ModelSpec, t: TrainingSpec) -> int:
    """Bytes GaLore's ``optimizer.step()`` allocates above what exists before it (``estimate.galore``):
    one optimizer over the non-target group, then the target weights (``galore.step_order``)."""
    return galore_step_events(m, t)[0]


def galore_step_events(m: ModelSpec, t: TrainingSpec) -> tuple[int, tuple]:
    """``galore_step_bytes`` and the allocations behind it, for the allocator replay."""
    return _galore_peak(t, step_order([x for _, x in _galore_tensors(m, t)]), False)


def galore_oib_bytes(m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """GaLore's layerwise variants (``oib_update_bytes``): one parameter's gradient plus its own
    optimizer's step peak, the largest among the tensors updated while activations are alive (all
    but the input embeddings) and among all."""
    def one(x: GTensor) -> int:
        return int(block_of(t, x.numel * t.weight_bytes)) + _galore_peak(t, [x], True)[0]
    each = [(emb, one(x)) for emb, x in _galore_tensors(m, t)]
    return max([b for emb, b in each if not emb] + [0]), max(b for _, b in each)


def _copies_per_tensor(t: TrainingSpec, per_parameter: bool) -> int | None:
    """State-sized temporaries one optimizer step makes per tensor (None: the whole group's worth).
    SGD, with momentum or not, makes none: without weight decay or ``maximize`` (torch.optim.SGD's
    defaults, which the workload keeps) the foreach step is ``_foreach_mul_``/``_foreach_add_`` on
    the momentum buffers and ``_foreach_add_(params, grads, alpha=-lr)``, all in place, and the
    first step's buffers are ``grad.detach().clone()``, the state itself (torch 2.13
    ``torch/optim/sgd.py`` ``_multi_tensor_sgd`` L403-472; the for-loop ``_single_tensor_sgd`` alike).
    Found by trace: Mistral (2 layers) fp16-amp SGD momentum: +6.4% before (a gradient-sized
    temporary charged at the step)."""
    if t.optimizer in LOWRANK_OPTIMIZERS + LOMO_OPTIMIZERS:
        return 0  # replayed tensor by tensor (galore_step_bytes, galore_oib_bytes; lomo_update_bytes)
    if t.optimizer in ("sgd", "sgd-momentum", "schedule-free-sgd") + BNB_OPTIMIZERS + TORCHAO_OPTIMIZERS \
            or t.offload_optimizer or t.torchao_offload or t.fsdp_offload_params:
        # torchao's CPUOffloadOptimizer steps the tensors of >= 4096 elements on the host and copies them
        # back in place (``p_device.copy_(p_host, non_blocking=True)``, cpu_offload.py L131-135); the
        # smaller ones' on-device optimizer is fused AdamW by default (none) and small
        # torchao's compiled step makes buffers, not state-sized copies: ``torchao_optim.step_events``
        # bitsandbytes' step is one in-place CUDA kernel per tensor (``optimizer_update_8bit_blockwise``
        # / ``optimizer_update_32bit`` write state1/2, absmax and the parameter in place); schedule-free
        # SGD's is ``lerp_``/``add_``/``sub_`` on y, z and the gradient (``sgd_schedulefree.py`` L155-186)
        return 0
    if t.optimizer in ("rmsprop", "schedule-free-adamw", "schedule-free-radam") and t.impl != "foreach":
        # for-loop: one temporary of the tensor's size, the rest in place (rmsprop.py L325 ``avg =
        # square_avg.sqrt()`` then ``avg.add_(eps)``; schedule_free ``denom = exp_avg_sq.div(bc2).sqrt_().add_(eps)``
        # and ``grad.div_(denom)``)
        return 1
    if t.optimizer == "adagrad" and t.impl != "fused":
        # for-loop: ``std = state_sum.sqrt().add_(eps)``, then ``param.addcdiv_(grad, std)`` (adagrad.py
        # L423-426); foreach, a group of one under optimizer-in-backward: ``foreach_groups``
        return (2 if per_parameter else None) if t.impl == "foreach" else 1
    if t.optimizer == "lion":
        # lion-pytorch (lion_pytorch.py ``update_fn``), a loop over tensors whatever optimizer_impl says:
        # ``update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()``: the clone and
        # the sum coexist, two tensors of the parameter's size
        return 2
    if t.impl == "fused":
        return 0
    if t.impl == "foreach":
        return 1 if per_parameter else None
    return 2


def oib_update_bytes(m: ModelSpec, t: TrainingSpec, st: States) -> tuple[int, int]:
    """Optimizer-in-backward: the gradient of one parameter plus its update's temporaries, alive
    together inside its post-accumulate-grad hook (the gradient is freed right after). Returns the
    largest such amount among tensors updated while activations are alive (all but the input
    embeddings, e.g. an untied LM head right after the loss) and among all (the embeddings, whose
    gradients complete last). Sharded (ZeRO/FSDP2) tensors update their shard."""
    if t.optimizer in LOWRANK_OPTIMIZERS:
        return galore_oib_bytes(m, t)
    if t.optimizer in LOMO_OPTIMIZERS:
        return lomo_update_bytes(m, t)
    k = _copies_per_tensor(t, True) or 0
    sb = 4 if (t.weight_bytes == 4 or t.fp32_master) else t.weight_bytes
    gb = t.main_grad_bytes or t.weight_bytes
    d = t.shard_group if t.zero_stage >= 1 else 1
    if t.lora_rank:
        n_all = n_mid = st.largest_param // sb  # adapters only, all inside the layers
    else:
        sizes = [(p.role == "embedding", p.numel if t.tp == 1 or p.role in ("norm", "router")
                  else -(-p.numel // t.tp)) for p in m.parameter_tensors()]
        n_all = max(n for _, n in sizes)
        n_mid = max([n for emb, n in sizes if not emb] + [0])

    def one(n: int) -> int:
        n = -(-n // d)
        ao = torchao_optim.step_peak(t.optimizer, n, t.torchao_block, lambda x: block_of(t, x)) \
            if t.torchao_block else 0  # torchao: the tensor's compiled-step buffers
        return block_of(t, n * gb) + k * block_of(t, n * sb) + ao
    return one(n_mid), one(n_all)
