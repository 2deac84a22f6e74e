"""FSDP1's wrap of a model that rank 0 holds on the CPU, with ``sync_module_states=True``
(``TrainingSpec.fsdp_sync_module_states``), as alloc/free events for the reserved-memory replay.

Who loads this way: Answer.AI's fsdp_qlora ``train.py`` (50efa1e, ``low_memory`` True by default:
rank 0 loads the model on the CPU, the other ranks build it on the meta device, L555-563 / L627;
``FSDP(..., device_id=torch.cuda.current_device(), sync_module_states=low_memory, param_init_fn=
module.to_empty(device="cuda", recurse=False) on ranks other than 0)``, L704-716), and accelerate's
``fsdp_cpu_ram_efficient_loading`` (which sets ``sync_module_states``). Rank 0's GPU holds nothing of
the model before the wrap but what the loader left there (fsdp_qlora: each 4-bit weight's quant state,
which is no parameter: ``load_and_quantize`` L168-212, then ``torch.cuda.empty_cache()`` L633).

FSDP1 wraps bottom-up (``_recursive_wrap``: a unit's children first), so the units come in this order:
per decoder layer, under peft's policy, each adapter linear's own unit (``lora_A`` then ``lora_B`` of
each targeted linear), then the layer; the root (embeddings, final norm, head) last. Each unit, in
``_init_param_handle_from_module`` (read at torch 2.13, ``distributed/fsdp/_init_utils.py`` L563-642;
the Answer.AI fixtures' torch 2.2 has the same functions, not re-read line by line here):

1. ``_move_module_to_device`` (L977-1028) -> ``_move_states_to_device`` (L1031-1059): each of the
   unit's parameters still on the CPU, then each buffer, copied to the GPU one tensor at a time
   (``param.data = param.to(device)``), in the module tree's breadth-first order (a layer's norms
   before its linears, a peft-wrapped linear's ``base_layer`` after the plain ones);
2. ``_sync_module_params_and_buffers`` (L1110-1167): the not yet synced buffers, then the parameters,
   broadcast from rank 0 by ``dist._broadcast_coalesced`` with 250 MiB buckets
   (``PARAM_BROADCAST_BUCKET_SIZE``, L60): comm.cpp ``broadcast_coalesced`` flattens each bucket into
   a new tensor, at most two in flight (``reserved.ddp.flat_copies``: a bucket of one tensor is no copy, as in DDP's construction);
3. ``_init_param_handle_from_params`` (L645-672): ``FlatParamHandle`` flattens the parameters into one
   new tensor (``flatten_tensors``, ``torch.cat``, ``_flat_param.py`` L838-893; no alignment padding
   with ``use_orig_params=False``), then ``shard()`` (L945-975) clones this rank's chunk
   (``_get_shard`` L1122-1138: ``ceil(numel / world)`` elements) and frees the flat tensor's storage;
   under ``NO_SHARD`` the flat tensor stays the parameter. ``CPUOffload(offload_params=True)`` then
   moves the shard to the host (``flat_param_to(cpu)``, L670-672);
4. the moved parameters' GPU copies die with the function's ``managed_params`` list (the module's
   attributes are now views of the flat parameter, ``_use_unsharded_views``); the moved buffers stay.

Nothing of it is freed with ``empty_cache``: the segments these transients opened stay reserved into
the training loop (fsdp_qlora's ``reset_peak_memory_stats()`` before the loop, L789, restarts the
allocated peak, not what is reserved), and the step's blocks land in them."""
from __future__ import annotations

from typing import Any

#: ``PARAM_BROADCAST_BUCKET_SIZE`` (torch 2.13 ``distributed/fsdp/_init_utils.py`` L60)
SYNC_BUCKET_BYTES = 250 * 1024 * 1024


def _depth(name: str, wrapped: bool) -> int:
    """A parameter's module depth in the tree FSDP's breadth-first move walks: a linear that peft wraps
    holds its weight one level deeper (``q_proj.base_layer.weight``). trainmem's names drop the base
    model's prefix (``model.``), so in the root the head, which the walk moves first (a child of the
    ``*ForCausalLM``), comes after the embedding here: the same bytes in Llama-2, Mistral and Yi."""
    return name.count(".") + (1 if wrapped else 0)


def unit_events(params: list[tuple[str, int, bool]], buffers: list[int], elem: int, world: int,
                sharded: bool, offload: bool, ids: list[int]) -> list[tuple]:
    """The alloc/free events of one unit's wrap (the module doc's steps 1-4) on rank 0.
    ``params``: (name, bytes, wrapped by peft) in parameter-registration order, one dtype of
    ``elem`` bytes (a flat parameter's); ``buffers``: bytes of its buffers not yet on the GPU (they
    stay); ``ids``: a one-element counter for event ids. Returns events ``("a", id, bytes)`` /
    ``("f", id)``."""
    from .reserved import flat_copies
    ev: list[tuple] = []

    def alloc(nbytes: int) -> int:
        ids[0] += 1
        ev.append(("a", ids[0], int(nbytes)))
        return ids[0]
    moved = [alloc(b) for _n, b, _w in sorted(params, key=lambda p: _depth(p[0], p[2]))]   # 1. params (BFS)
    for b in buffers:                                                                     # ... then buffers
        alloc(b)
    live: list[int] = []
    for nbytes in flat_copies(list(buffers) + [b for _n, b, _w in params], SYNC_BUCKET_BYTES):   # 2.
        if len(live) == 2:                                       # max_in_flight = 2 (comm.cpp)
            ev.append(("f", live.pop(0)))
        live.append(alloc(nbytes))
    ev.extend(("f", h) for h in live)
    total = sum(b for _n, b, _w in params)
    flat = alloc(total)                                          # 3. torch.cat of the parameters
    shard = None
    if sharded:
        numel = -(-total // elem)
        shard = alloc(-(-numel // world) * elem)                 # ... this rank's chunk, cloned
        ev.append(("f", flat))                                   # ... the flat tensor's storage freed
    ev.extend(("f", h) for h in moved)                           # 4. the moved copies die
    if offload and shard is not None:                            # CPUOffload: the shard goes to the host
        ev.append(("f", shard))
    return ev


def sync_init_events(units: list[tuple[list[tuple[str, int, bool]], list[int]]], resident: list[int],
                     elem: int, world: int, sharded: bool, offload: bool) -> tuple:
    """The whole wrap's events: ``resident`` (bytes of what the loader left on the GPU before the
    wrap: fsdp_qlora's quant states, in load order) allocated first, then each unit's
    (``unit_events``), in wrap order ``units``: (parameters, buffers) per unit."""
    ids = [0]
    ev: list[tuple] = []
    for b in resident:
        ids[0] += 1
        ev.append(("a", ids[0], int(b)))
    for params, buffers in units:
        if params or buffers:
            ev.extend(unit_events(params, buffers, elem, world, sharded, offload, ids))
    return tuple(ev)


def wrap_units(t: Any, root: list[tuple[str, int]], layer_params: list[tuple[str, int]], targets: set,
               adapters: list[tuple[int, int]], loaded: tuple[list, list, list], per_layer: int
               ) -> tuple[list, list[int]]:
    """The units in FSDP1's wrap order and the loader's resident tensors. ``root`` and
    ``layer_params``: (name, whole bytes) of the parameters outside the layers and of one layer (a
    4-bit weight: its packed codes, ``quant4.fsdp_packed_bytes``), in registration order; ``targets``:
    the modules peft wraps; ``adapters``: bytes of one layer's LoRA A and B matrices, in order;
    ``loaded``: the estimate's load lists (``states._model_states``: before, one layer, after, as
    (name, bytes held)), whose entries that are no parameter are the buffers (moved with their unit)
    and the 4-bit weights' quant-state parts (``name.4bit.i``, i >= 1: resident before the wrap);
    ``layer`` stands for ``per_layer`` layers. Adapters are units of their own before their layer's
    (``fsdp_lora_units="separate"``, peft's policy) or parameters of it (``"layer"``)."""
    names = {n for n, _b in root + layer_params}

    def kinds(items: list) -> tuple[list[int], list[int]]:
        """(buffers, quant-state parts) of a load list, in order."""
        bufs, quant = [], []
        for name, held in items:
            if ".4bit." in name and not name.endswith(".4bit.0"):
                quant.append(held)
            elif name.split(".4bit.")[0] not in names:
                bufs.append(held)
        return bufs, quant
    before, layer, after = loaded
    lb, lq = kinds(layer)
    rb = kinds(before + after)[0]
    resident = kinds(before)[1] + lq * per_layer + kinds(after)[1]
    lp = [(n, b, n.split(".")[-2] in targets) for n, b in layer_params]
    own = [[(f"lora_{i}", b, False)] for i, b in enumerate(adapters)]
    units: list = []
    for _ in range(per_layer):
        if t.fsdp_lora_units == "separate":
            units.extend((a, []) for a in own)
            units.append((lp, lb))
        else:
            units.append((lp + [x for a in own for x in a], lb))
    units.append(([(n, b, False) for n, b in root], rb))
    return units, resident
