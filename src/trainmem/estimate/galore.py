"""GaLore's (and APOLLO's) memory: the projector and projected states of each target matrix, and the
step's temporaries.

From galore_torch 1.0 (the ``galore-torch`` wheel the HF Trainer imports; github:jiaweizzhao/GaLore):

* ``GaLoreProjector`` (``galore_projector.py``): ``proj_type`` "std" projects an (m, n) gradient on the
  right when m >= n (``grad @ P.t()``, P (r, n): the projected gradient (m, r)) and on the left
  otherwise (``P.t() @ grad``, P (m, r): (r, n)); "reverse_std" the other way round; "right"/"left"
  always that side; "full" both (P = [A (m, r), B (r, n)], projected (r, r)). Every ``update_proj_gap``
  steps (and at the first) ``get_orthogonal_matrix`` runs ``torch.linalg.svd(matrix,
  full_matrices=False)`` on the fp32 gradient (a ``.float()`` copy of a half one, L74-83): U (m, k),
  S (k,), Vh (k, n), k = min(m, n). The projector it keeps is ``Vh[:r, :]`` / ``U[:, :r]``: for a
  half gradient cast to a new (r, n) / (m, r) tensor in that dtype (L90-104), for an fp32 gradient
  that *view*, which keeps the whole (k, n) Vh / (m, k) U storage alive as long as the projector.
  "right" also computes ``A = U[:, :r] @ torch.diag(s[:r])`` and "left" ``B = diag @ Vh[:r]``, unused.
  ``project_back`` returns ``(P-side matmul) * scale``: two (m, n) tensors at once (L47-67).
* ``GaLoreAdamW.step`` (``adamw.py``, a loop over tensors, no foreach): states ``zeros_like(grad)``
  of the projected gradient (its dtype: the parameter's); ``denom = exp_avg_sq.sqrt().add_(eps)``,
  ``norm_grad = exp_avg / denom``, projected back, ``p.add_``. The loop's locals ``grad``, ``denom``,
  ``norm_grad`` keep the last tensor's until the next one rebinds them. The param groups are the
  non-target parameters (plain Adam, no projection) then the target weights (``_setup_low_rank_optimizer``).
* ``GaLoreAdamW8bit.step`` (``adamw8bit.py`` L42-75): bitsandbytes' ``Optimizer2State`` on the projected
  gradient: ``p.saved_data = p.data.clone()``, ``p.data = grad.clone()`` (the projected shape; the
  weight's old storage freed), ``p.grad = grad`` (the full gradient freed: it is never restored),
  the 8-bit update in place, then ``p.data = p.saved_data.add_(project_back(p.data))``.
* ``GaLoreAdafactor.step`` (``adafactor.py`` L164-265): a half gradient is upcast (``grad.float()``),
  so the projector is always computed from fp32; states of the projected fp32 gradient (factored:
  row and column); a half weight's fp32 copy ``p_data_fp32``; ``update = grad**2 + eps``, the
  factored ``torch.mul(r_factor, c_factor)``, projected back, ``p_data_fp32.add_(-update)``.

APOLLO (apollo_torch 1.0.3 ``apollo.py``, ``random_projector.py``), the HF Trainer's ``apollo_adamw``: the
same two groups and AdamW, a random projector in the gradient's dtype, and a channel-scaled full gradient
(``_apollo_tensor``).

``step_peak`` replays these allocations tensor by tensor (``_Live``); a real CPU run of galore_torch
checks it byte for byte (tests/test_galore.py; apollo_torch: tests/test_apollo.py). The SVD's own work
buffers (LAPACK's / cuSOLVER's workspace) are not modelled; its input copy is (``linalg_svd`` clones the matrix column-major for
LAPACK/cuSOLVER, which overwrite it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["side_of", "projected_shape", "projector_bytes", "galore_state_bytes", "GTensor", "step_peak"]


def side_of(shape: tuple[int, int], proj_type: str) -> str:
    """Which side ``GaLoreProjector.project`` projects an (m, n) gradient on (galore_projector.py L14-43)."""
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def rank_of(shape: tuple[int, int], rank: int) -> int:
    """The projection's rank for an (m, n) matrix (``_rank``)."""
    return _rank(shape, rank)


def _rank(shape: tuple[int, int], rank: int) -> int:
    """``U[:, :rank]`` / ``Vh[:rank]`` keep at most k = min(m, n) of them."""
    return min(rank, *shape)


def projected_shape(shape: tuple[int, int], rank: int, proj_type: str) -> tuple[int, int]:
    """Shape of the projected gradient (and of the Adam states kept on it)."""
    m, n = shape
    r, side = _rank(shape, rank), side_of(shape, proj_type)
    return {"right": (m, r), "left": (r, n), "full": (r, r)}[side]


def projector_bytes(shape: tuple[int, int], rank: int, proj_type: str, grad_bytes: int) -> tuple[int, ...]:
    """Bytes of the storages the projector keeps alive: cast copies (r, n) / (m, r) in the gradient's
    dtype for a half gradient; the whole fp32 Vh (k, n) / U (m, k) the view belongs to for an fp32
    one (``get_orthogonal_matrix`` L86-105)."""
    m, n = shape
    r, k, side = _rank(shape, rank), min(shape), side_of(shape, proj_type)
    if grad_bytes == 4:
        return {"right": (k * n * 4,), "left": (m * k * 4,), "full": (m * k * 4, k * n * 4)}[side]
    g = grad_bytes
    return {"right": (r * n * g,), "left": (m * r * g,), "full": (m * r * g, r * n * g)}[side]


def galore_state_bytes(optimizer: str, shape: tuple[int, ...], target: bool, w: int, rank: int, proj_type: str,
                       blocksize: int = 256) -> tuple[int, ...]:
    """State tensors of one parameter, bytes each (``w``: the parameter's bytes per element; its
    gradient has the same dtype, GaLore runs without master weights). Non-target parameters: plain
    Adam states in that dtype (``zeros_like(grad)``), bitsandbytes' 8-bit states, or Adafactor's
    fp32 ones. Target weights: the projector, then the states of the projected gradient."""
    n_el = 1
    for d in shape:
        n_el *= d
    if optimizer == "apollo-adamw":                              # APOLLO's plain group: GaLore's AdamW's states
        optimizer = "galore-adamw" if not target else optimizer
    if not target:
        return _plain_states(optimizer, shape, n_el, w, blocksize)
    if optimizer == "apollo-adamw":
        # apollo_torch 1.0.3 random_projector.py L115-145: a new random (r, n) / (m, r) tensor in the gradient's
        # dtype (fp32 generated, cast for a half one: never a view of a larger one); the Adam states of the
        # projected gradient; state["scaled_grad"], a 0-dim tensor of the gradient's dtype (apollo.py L160-170)
        a, b = projected_shape(shape, rank, proj_type)
        proj = rank_of(shape, rank) * (shape[1] if side_of(shape, proj_type) == "right" else shape[0]) * w
        return (proj, a * b * w, a * b * w, w)
    gdt = 4 if optimizer == "galore-adafactor" else w   # GaLoreAdafactor projects grad.float()
    a, b = projected_shape(shape, rank, proj_type)
    return projector_bytes(shape, rank, proj_type, gdt) + _plain_states(optimizer, (a, b), a * b, gdt, blocksize)


def _plain_states(optimizer: str, shape: tuple[int, ...], numel: int, w: int, blocksize: int) -> tuple[int, ...]:
    if optimizer == "galore-adamw":
        return (numel * w, numel * w)                            # exp_avg, exp_avg_sq: zeros_like(grad)
    if optimizer == "galore-adamw-8bit":                         # bitsandbytes' Optimizer2State("adam", 8 bits)
        from .states import bnb_state_bytes
        return bnb_state_bytes("adamw-8bit", numel, numel, blocksize)
    rms = (4,)                                                   # Adafactor's state["RMS"]: an fp32 scalar tensor
    if len(shape) >= 2:                                          # factored: row, column (fp32)
        lead = numel // (shape[-1] * shape[-2])
        return (lead * shape[-2] * 4, lead * shape[-1] * 4) + rms
    return (numel * 4,) + rms


@dataclass(frozen=True)
class GTensor:
    """One trainable tensor as the step sees it: shape, GaLore target or not."""

    shape: tuple[int, ...]
    target: bool

    @property
    def numel(self) -> int:
        out = 1
        for d in self.shape:
            out *= d
        return out


class _Live:
    """Live bytes above the state before the step (freeing a tensor that existed before it, such as
    a gradient, goes below zero), each request rounded by ``blk``; ``peak`` the highest. ``events``
    records each allocation ("a", id, bytes) and free ("f", id) made here, for the allocator replay."""

    def __init__(self, blk: Callable[[int], int], scratch: bool = True) -> None:
        self.blk, self.now, self.peak = blk, 0, 0
        self.held: dict[str, list[tuple[int, int]]] = {}   # name -> its allocations (id, bytes)
        self.events: list[tuple] = []
        self.scratch = scratch  # count linalg_svd's in-kernel input copy (step_peak)

    def alloc(self, key: str, nbytes: int) -> None:
        if not nbytes:
            return
        b = self.blk(nbytes)
        self.held.setdefault(key, []).append((len(self.events), b))
        self.events.append(("a", len(self.events), b))
        self.now += b
        self.peak = max(self.peak, self.now)

    def free(self, key: str) -> None:
        for i, b in self.held.pop(key, []):
            self.events.append(("f", i))
            self.now -= b

    def drop(self, nbytes: int) -> None:
        """A tensor made before the step is freed (a gradient replaced, an old projector)."""
        self.now -= self.blk(nbytes) if nbytes else 0

    def rebind(self, old: str, new: str) -> None:
        """``old = <new tensor>``: the previous value freed once the new one exists."""
        self.free(old)
        self.held[old] = self.held.pop(new, [])

    def keep(self, key: str, *into: str) -> None:
        """What ``into`` holds becomes part of what persists past the step (a state, a gradient)."""
        for k in into:
            self.held.setdefault(key, []).extend(self.held.pop(k, []))


def _svd(L: _Live, shape: tuple[int, int], gdt: int, rank: int, proj_type: str) -> None:
    """``get_orthogonal_matrix`` on an (m, n) gradient of ``gdt`` bytes per element, the previous
    projector alive until ``self.ortho_matrix`` is rebound (key "P"): the fp32 copy of a half
    gradient, ``linalg_svd``'s column-major input copy and its U, S, Vh, the unused ``A``/``B``
    product (with its ``diag``), then the kept projector; everything but the projector freed."""
    m, n = shape
    r, k, side = _rank(shape, rank), min(shape), side_of(shape, proj_type)
    if gdt != 4:
        L.alloc("svd.mat", m * n * 4)                            # module_params.data.float()
    if L.scratch:
        L.alloc("svd.in", m * n * 4)                             # the input copy LAPACK/cuSOLVER overwrite
    for key, nb in (("svd.U", m * k * 4), ("svd.S", k * 4), ("svd.Vh", k * n * 4)):
        L.alloc(key, nb)
    L.free("svd.in")
    if side in ("right", "left"):
        L.alloc("svd.diag", r * r * 4)                           # torch.diag(s[:rank]), freed once the
        L.alloc("svd.AB", (m * r if side == "right" else r * n) * 4)  # product exists
        L.free("svd.diag")
    keep = projector_bytes(shape, rank, proj_type, gdt)
    if gdt != 4:
        for nb in keep:
            L.alloc("P.new", nb)                                 # .type(original_type): new tensors
    L.free("svd.diag")
    L.free("svd.AB")
    if gdt == 4:                                                 # views: U and/or Vh stay as the projector
        L.free("svd.S")
        for key in (("svd.U",) if side == "right" else ("svd.Vh",) if side == "left" else ()):
            L.free(key)
        L.keep("P.new", "svd.U", "svd.Vh")
    for nb in keep:
        L.drop(nb)                                               # self.ortho_matrix rebound: the old one freed
    L.keep("states", "P.new")
    for key in ("svd.U", "svd.S", "svd.Vh", "svd.mat"):
        L.free(key)


def _project(L: _Live, key: str, shape: tuple[int, int], out: tuple[int, int], g: int, side: str) -> None:
    """``project``: one matmul, (a, b) in the gradient's dtype; "full" first makes ``A.t() @ grad`` (r, n)."""
    if side == "full":
        L.alloc("proj.mid", out[0] * shape[1] * g)
    L.alloc(key, out[0] * out[1] * g)
    L.free("proj.mid")


def _project_back(L: _Live, key: str, shape: tuple[int, int], g: int, side: str, rank: int) -> None:
    """``project_back``: the (m, n) matmul ("full": ``A @ low`` (m, r) first), then ``* self.scale``,
    a second (m, n) tensor, into ``key``."""
    m, n = shape
    if side == "full":
        L.alloc("back.mid", m * _rank(shape, rank) * g)
    L.alloc("back", m * n * g)
    L.free("back.mid")
    L.alloc(key, m * n * g)
    L.free("back")


def _adamw_tensor(L: _Live, x: GTensor, w: int, rank: int, proj_type: str, svd: bool) -> None:
    """One tensor of ``GaLoreAdamW.step`` (adamw.py L188-250); locals "grad", "denom", "norm" linger."""
    L.free("grad")                                               # grad = p.grad: the last projected one
    if x.target:
        if svd:
            _svd(L, x.shape, w, rank, proj_type)
        a, b = projected_shape(x.shape, rank, proj_type)
        _project(L, "grad", x.shape, (a, b), w, side_of(x.shape, proj_type))
        small = a * b * w
    else:
        small = x.numel * w
    L.alloc("denom.new", small)                                  # exp_avg_sq.sqrt().add_(eps)
    L.rebind("denom", "denom.new")
    L.alloc("norm.new", small)                                   # exp_avg / denom
    L.rebind("norm", "norm.new")
    if x.target:
        _project_back(L, "norm.new", x.shape, w, side_of(x.shape, proj_type), rank)
        L.rebind("norm", "norm.new")


def _adamw8bit_tensor(L: _Live, x: GTensor, w: int, rank: int, proj_type: str, svd: bool) -> None:
    """One tensor of ``GaLoreAdamW8bit.step`` (adamw8bit.py L42-75); bitsandbytes' update is in place."""
    if not x.target:
        return
    if svd:
        _svd(L, x.shape, w, rank, proj_type)
    a, b = projected_shape(x.shape, rank, proj_type)
    _project(L, "grad.new", x.shape, (a, b), w, side_of(x.shape, proj_type))  # grad = project(p.grad)
    L.alloc("saved", x.numel * w)                                # p.saved_data = p.data.clone()
    L.alloc("pdata", a * b * w)                                  # p.data = grad.clone()
    L.drop(x.numel * w)                                          # ... the weight's old storage freed
    L.drop(x.numel * w)                                          # p.grad = grad: the full gradient freed
    L.rebind("grad", "grad.new")                                 # (the local; p.grad holds it until zero_grad)
    L.keep("grads", "grad")
    _project_back(L, "scaled", x.shape, w, side_of(x.shape, proj_type), rank)
    L.free("scaled")                                             # saved_data.add_(...) done
    L.free("pdata")                                              # p.data = p.saved_data
    L.keep("weights", "saved")


def _adafactor_tensor(L: _Live, x: GTensor, w: int, rank: int, proj_type: str, svd: bool) -> None:
    """One tensor of ``GaLoreAdafactor.step`` (adafactor.py L177-265, beta1 None: no first moment);
    locals "grad", "pf" (p_data_fp32), "update" linger."""
    L.free("grad")                                               # grad = p.grad
    if w != 4:
        L.alloc("grad", x.numel * 4)                             # grad.float()
    shape = x.shape
    if x.target:
        if svd:
            _svd(L, x.shape, 4, rank, proj_type)
        shape = projected_shape(x.shape, rank, proj_type)
        _project(L, "grad.new", x.shape, shape, 4, side_of(x.shape, proj_type))  # grad = project(grad)
        L.rebind("grad", "grad.new")
    small = 1
    for d in shape:
        small *= d
    L.free("pf")                                                 # p_data_fp32 = p
    if w != 4:
        L.alloc("pf", x.numel * 4)                               # p_data_fp32.float()
    _rms(L, "rms.new")                                           # state["RMS"] = self._rms(p_data_fp32): the
    L.drop(4)                                                    # tensor's previous one freed
    L.keep("states", "rms.new")
    L.alloc("sq", small * 4)                                     # grad ** 2
    L.alloc("update.new", small * 4)                             # ... + eps
    L.free("sq")
    L.rebind("update", "update.new")
    if len(shape) >= 2:                                          # factored: row/col means, then
        rows, cols = small // shape[-1], small // shape[-2]     # (a,) and (b,) for an (a, b) gradient
        L.alloc("mean", rows * 4)                                # update.mean(dim=-1)
        L.free("mean")
        L.alloc("mean", cols * 4)                                # update.mean(dim=-2)
        L.free("mean")
        L.alloc("rmean", rows // shape[-2] * 4)                  # exp_avg_sq_row.mean(-1, keepdim): (1,)
        L.alloc("rdiv", rows * 4)                                # row / mean, rsqrt_ in place
        L.free("rmean")
        L.alloc("cf", cols * 4)                                  # col.unsqueeze(-2).rsqrt()
        L.alloc("update.new", small * 4)                         # torch.mul(r_factor, c_factor)
        L.free("rdiv")
        L.free("cf")
        L.rebind("update", "update.new")
    else:
        L.alloc("update.new", small * 4)                         # exp_avg_sq.rsqrt()
        L.rebind("update", "update.new")
    _rms(L, "clip")                                              # update.div_((self._rms(update) / clip_threshold)
    L.alloc("clip2", 4)                                          # .clamp_(min=1.0))
    L.free("clip")
    L.free("clip2")
    if x.target:
        _project_back(L, "update.new", x.shape, 4, side_of(x.shape, proj_type), rank)
        L.rebind("update", "update.new")
    L.alloc("neg", x.numel * 4)                                  # p_data_fp32.add_(-update)
    L.free("neg")


def _random_projector(L: _Live, shape: tuple[int, int], w: int, rank: int, proj_type: str) -> None:
    """apollo_torch's ``GradientProjector.get_orthogonal_matrix`` (random_projector.py L115-145): a half
    gradient's ``.float()`` copy (made, unused but for its shape), ``stable_randn`` fp32, ``/ sqrt(rank)``,
    cast to a half gradient's dtype; the previous projector freed when ``ortho_matrix`` is rebound."""
    m, n = shape
    elems = rank_of(shape, rank) * (n if side_of(shape, proj_type) == "right" else m)
    if w != 4:
        L.alloc("svd.mat", m * n * 4)
    L.alloc("rnd", elems * 4)
    L.alloc("P.new", elems * 4)
    L.free("rnd")
    if w != 4:
        L.alloc("P.cast", elems * w)
        L.free("P.new")
        L.keep("P.new", "P.cast")
    L.free("svd.mat")
    L.drop(elems * w)                                            # the old projector
    L.keep("states", "P.new")


def _apollo_tensor(L: _Live, x: GTensor, w: int, rank: int, proj_type: str, svd: bool) -> None:
    """One tensor of apollo_torch 1.0.3 ``APOLLOAdamW.step`` (apollo.py L118-180, scale_type channel,
    proj std): GaLore's AdamW on the projected gradient, then the channel norms of ``norm_grad`` and of
    the projected gradient (vectors of the long side), ``scaled_grad = p.grad * factor`` (m, n), the
    norm-growth limiter's ``scaled_grad / limiter`` (another (m, n), the first freed) and
    ``norm_grad = scaled_grad``; ``scaled_grad`` keeps it until the next target's replaces it. The
    limiter is a tensor when the norm grew by over 1 % (the larger path: counted)."""
    L.free("grad")
    if not x.target:
        _adamw_tensor(L, x, w, rank, proj_type, svd)
        return
    if svd:
        _random_projector(L, x.shape, w, rank, proj_type)
    a, b = projected_shape(x.shape, rank, proj_type)
    _project(L, "grad", x.shape, (a, b), w, "right" if x.shape[0] >= x.shape[1] else "left")
    for key in ("denom", "norm"):
        L.alloc(key + ".new", a * b * w)
        L.rebind(key, key + ".new")
    vec = max(x.shape)                                           # torch.norm(..., dim=low-rank dimension)
    L.alloc("v1", vec * w)
    L.alloc("v2", vec * w)
    L.alloc("v3", vec * w)                                       # + 1e-8
    L.free("v2")
    L.alloc("fac.new", vec * w)                                  # the quotient
    L.free("v1")
    L.free("v3")
    L.rebind("fac", "fac.new")
    L.alloc("scaled.new", x.numel * w)                           # p.grad * grad_scaling_factor
    L.rebind("scaled", "scaled.new")
    L.alloc("sn.new", w)                                         # scaled_grad_norm = torch.norm(scaled_grad)
    L.rebind("sn", "sn.new")
    L.alloc("s1", w)                                             # state["scaled_grad"] + 1e-8
    L.alloc("s2", w)                                             # the ratio (s1 freed with the expression)
    L.free("s1")
    L.alloc("lim.new", w)                                        # max(ratio, 1.01) / 1.01
    L.free("s2")
    L.rebind("limiter", "lim.new")
    L.alloc("scaled.new", x.numel * w)                           # scaled_grad / limiter
    L.rebind("scaled", "scaled.new")
    L.alloc("st.new", w)                                         # state["scaled_grad"] = ... / limiter
    L.drop(w)
    L.keep("states", "st.new")
    L.free("norm")                                               # norm_grad = scaled_grad (an alias)


def _rms(L: _Live, key: str) -> None:
    """``Adafactor._rms``: ``tensor.norm(2) / (tensor.numel() ** 0.5)``, two fp32 scalars, the first freed."""
    L.alloc("rms.norm", 4)
    L.alloc(key, 4)
    L.free("rms.norm")


_STEPS = {"galore-adamw": _adamw_tensor, "galore-adamw-8bit": _adamw8bit_tensor,
          "galore-adafactor": _adafactor_tensor, "apollo-adamw": _apollo_tensor}


def step_peak(tensors: list[GTensor], optimizer: str, w: int, rank: int, proj_type: str, svd: bool,
              blk: Callable[[int], int] = lambda b: b, layerwise: bool = False, scratch: bool = True) -> int:
    """Peak bytes above the state before ``optimizer.step()`` (states made, gradients alive).
    ``tensors`` in the order the step visits them: the non-target group, then the targets (one
    optimizer over both), or any order with ``layerwise`` (one optimizer per parameter, called from
    its hook: its locals die with each call; the result is the largest single call's peak).
    ``svd``: a projector-update step (the first, and every ``update_proj_gap``-th); ``scratch``: count
    ``linalg_svd``'s input copy (made inside the kernel: the caching allocator sees it on a GPU, a
    dispatcher-level count such as ``LiveBytes`` on the CPU does not)."""
    return step_replay(tensors, optimizer, w, rank, proj_type, svd, blk, layerwise, scratch)[0]


def step_replay(tensors: list[GTensor], optimizer: str, w: int, rank: int, proj_type: str, svd: bool,
                blk: Callable[[int], int] = lambda b: b, layerwise: bool = False,
                scratch: bool = True) -> tuple[int, tuple]:
    """``step_peak`` and the step's allocation events (``_Live.events``; layerwise: the calls one
    after the other)."""
    one = _STEPS[optimizer]
    if layerwise:
        best, events = 0, []
        for x in tensors:
            L = _Live(blk, scratch)
            one(L, x, w, rank, proj_type, svd)
            best = max(best, L.peak)
            events += [(e[0], (len(events), e[1])) + e[2:] for e in L.events]
        return best, tuple(events)
    L = _Live(blk, scratch)
    for x in tensors:
        one(L, x, w, rank, proj_type, svd)
    return L.peak, tuple(L.events)


def step_order(tensors: list[GTensor]) -> list[GTensor]:
    """The order one optimizer over ``_setup_low_rank_optimizer``'s two groups visits them: the
    non-target parameters, then the target weights, each in ``model.named_parameters()`` order."""
    return [x for x in tensors if not x.target] + [x for x in tensors if x.target]
