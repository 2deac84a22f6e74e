"""Command line: parse -> specs -> API call -> render. Bad input: one line on stderr, exit 2."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .errors import TrainmemError
from .spec.training import ATTENTION, OPTIMIZERS, OPTIMIZER_IMPLS, PRECISIONS, RECOMPUTE, FSDP_MODES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one clear line, exit 2 (no usage dump)
        sys.stderr.write(f"trainmem: error: {message} (see `trainmem {self.prog.split()[-1]} --help`)\n"
                         if " " in self.prog else f"trainmem: error: {message} (see `trainmem --help`)\n")
        raise SystemExit(2)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, with a one-line message otherwise."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{text} must be a positive integer" if minimum == 1
                                             else f"{text} must be zero or more")
        return v
    return parse


_positive_int = _int_at_least(1)
_nonneg_int = _int_at_least(0)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return v


def add_model_and_training(p: argparse.ArgumentParser) -> None:
    """MODEL and the training flags shared by estimate, trace, measure, compare, fit, sweep."""
    p.add_argument("model", metavar="MODEL",
                   help="catalogue name (`trainmem models`), config.json path, model directory or hub id")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable), e.g. --set num_hidden_layers=4")
    g = p.add_argument_group("training setup")
    g.add_argument("--batch-size", type=_positive_int, default=1, help="micro-batch per data-parallel rank")
    g.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sample (default 2048, or the model's learned positions if fewer)")
    g.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--precision", choices=PRECISIONS, default="bf16-amp",
                   help="amp = fp32 weights + autocast; bf16/fp16 = weights in that dtype")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    g.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default=None,
                   help="torch.optim implementation (default foreach, as PyTorch on CUDA)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over the DP group")
    g.add_argument("--fsdp", choices=FSDP_MODES, default=None)
    g.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload: optimizer states in CPU memory")
    g.add_argument("--distributed-optimizer", action="store_true",
                   help="Megatron/NeMo distributed optimizer (fp32 main grads, sharded states)")
    g.add_argument("--optimizer-bucket-mb", type=float, default=None, metavar="MiB",
                   help="distributed-optimizer bucket size (NeMo/apex); warns when larger than a layer")
    for k in ("dp", "tp", "pp", "cp"):
        g.add_argument(f"--{k}", type=_positive_int, default=1,
                       help={"dp": "data-parallel size", "tp": "tensor-parallel size",
                             "pp": "pipeline-parallel size", "cp": "context-parallel size"}[k])
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--recompute", choices=RECOMPUTE, default="none", help="activation recomputation")
    g.add_argument("--attention", choices=ATTENTION, default="sdpa")
    g.add_argument("--compile", action="store_true", help="torch.compile (fused loss backward)")
    g.add_argument("--keep-logits", action="store_true",
                   help="the loop holds the model output (logits) through backward (outputs = model(...); "
                        "default: only the loss is kept, as the HF Trainer does)")
    g.add_argument("--optimizer-in-backward", action="store_true",
                   help="apply the optimizer per parameter inside backward, freeing each gradient")
    g.add_argument("--lora-rank", type=_nonneg_int, default=0, metavar="R")
    g.add_argument("--lora-targets", default=None, metavar="M1,M2",
                   help="peft target module names (peft's defaults when omitted)")
    g.add_argument("--no-dropout", action="store_true", help="train with dropout off (no masks stored)")
    g.add_argument("--loss-chunks", type=_positive_int, default=1, metavar="N",
                   help="chunked cross-entropy: compute the logits and loss in N chunks of tokens")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu", default=None, metavar="NAME", help="GPU from `trainmem gpus`")
    h.add_argument("--gpu-memory", default=None, metavar="SIZE", help="custom GPU memory, e.g. 40GiB")
    h.add_argument("--context-memory", default=None, metavar="SIZE",
                   help="memory taken before training (CUDA context, other processes)")
    h.add_argument("--max-fraction", type=_fraction, default=None, metavar="F",
                   help="exit 1 when peak device memory exceeds F of the GPU")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the report as JSON")
    o.add_argument("--units", choices=("GiB", "GB"), default="GiB")
    o.add_argument("--detail", action="store_true", help="list every component, not categories")


def default_seq_len(model: str, overrides: list[str] | None) -> int:
    """2048 tokens, or fewer for a model with fewer learned positions (GPT-2, BERT: 1024, 512)."""
    from .spec.config import resolve_model
    from .spec.training import default_seq_len as for_model
    return for_model(resolve_model(model, overrides or None))


def training_options(a: argparse.Namespace, fill_defaults: bool = True) -> dict[str, Any]:
    """The TrainingSpec / hardware keyword options of parsed CLI flags (the API's names).
    ``fill_defaults``: an omitted --seq-len takes ``default_seq_len`` (fit searches it instead)."""
    if fill_defaults and getattr(a, "seq_len", None) is None:
        a.seq_len = default_seq_len(a.model, a.set)
    opts = dict(batch_size=a.batch_size, seq_len=a.seq_len, grad_accum=a.grad_accum, precision=a.precision,
                optimizer=a.optimizer, optimizer_impl=a.optimizer_impl, zero=a.zero, fsdp=a.fsdp,
                offload_optimizer=a.offload_optimizer, distributed_optimizer=a.distributed_optimizer,
                dp=a.dp, tp=a.tp, pp=a.pp, cp=a.cp, sequence_parallel=a.sequence_parallel,
                recompute=a.recompute, attention=a.attention, compile=a.compile, keep_logits=a.keep_logits,
                optimizer_in_backward=a.optimizer_in_backward, lora_rank=a.lora_rank,
                lora_targets=a.lora_targets, dropout=not a.no_dropout,
                optimizer_bucket_mb=a.optimizer_bucket_mb, loss_chunks=a.loss_chunks)
    if a.fsdp is not None and a.zero == 0:
        opts.pop("zero")
    return opts


def _emit(report, a: argparse.Namespace) -> int:
    from .render.table import render_report
    if a.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_report(report, a.units, a.detail))
        if report.fits is False and report.method == "trainmem":
            from .plan import format_suggestions, suggest_for_report
            print()
            print(format_suggestions(suggest_for_report(report), a.units))
    if a.max_fraction is not None and report.capacity is not None and not report.fits:
        return 1
    return 0


def cmd_estimate(a: argparse.Namespace) -> int:
    from .estimate.api import estimate
    if a.max_fraction is not None and a.gpu is None and a.gpu_memory is None:
        raise TrainmemError("--max-fraction needs a GPU: give --gpu NAME or --gpu-memory SIZE")
    r = estimate(a.model, method=a.method, set=a.set, gpu=a.gpu, gpu_memory=a.gpu_memory,
                 context_memory=a.context_memory, max_fraction=a.max_fraction, **training_options(a))
    return _emit(r, a)


def cmd_models(a: argparse.Namespace) -> int:
    from .spec.config import catalogue_names, resolve_model
    rows = []
    for n in catalogue_names():
        m = resolve_model(n)
        rows.append({"name": n, "family": m.family, "head": m.head, "params": m.num_params,
                     "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
                     "kv_heads": m.num_kv_heads, "vocab": m.vocab_size, "experts": m.num_experts})
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':18s} {'family':15s} {'head':10s} {'params':>16s} {'layers':>6s} {'hidden':>6s} "
          f"{'heads':>5s} {'kv':>4s} {'vocab':>7s}")
    for r in rows:
        print(f"{r['name']:18s} {r['family']:15s} {r['head']:10s} {r['params']:>16,d} {r['layers']:>6d} "
              f"{r['hidden']:>6d} {r['heads']:>5d} {r['kv_heads']:>4d} {r['vocab']:>7d}")
    return 0


def cmd_gpus(a: argparse.Namespace) -> int:
    from .spec.hardware import catalogue_table
    rows = catalogue_table()
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':16s} {'label':30s} {'capacity (bytes)':>18s} {'GiB':>8s} {'context':>9s} {'bf16 TF/s':>9s}")
    for r in rows:
        print(f"{r['name']:16s} {r['label']:30s} {r['capacity_bytes']:>18,d} {r['capacity_bytes'] / 2**30:8.2f} "
              f"{r['context_bytes'] / 2**20:6.0f}MiB {r['bf16_tflops']:9.0f}")
    print("capacity = total memory as NVML/nvidia-smi reports it; context = assumed memory taken before "
          "training (override with --context-memory)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = _Parser(prog="trainmem", description="How much GPU memory will this training run take, where does it "
                                             "go, will it fit?")
    p.add_argument("--version", action="version", version=f"trainmem {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    e = sub.add_parser("estimate", help="closed-form estimate from the model's hyperparameters")
    add_model_and_training(e)
    from .estimate.methods import METHODS
    e.add_argument("--method", choices=list(METHODS), default="trainmem", help="formula set")
    e.set_defaults(func=cmd_estimate)
    m = sub.add_parser("models", help="list the bundled model catalogue")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)
    g = sub.add_parser("gpus", help="list the GPU catalogue with exact capacities in bytes")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_gpus)
    for extra in _extra_commands():
        extra(sub)
    return p


def _extra_commands():
    """Subcommands contributed by other modules (trace, measure, fit, sweep, plan, ...)."""
    import importlib
    out = []
    for mod in ("trainmem.trace.cli", "trainmem.measure.cli", "trainmem.plan.cli", "trainmem.validate_cli"):
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("trainmem"):
                continue
            raise
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if not getattr(a, "func", None):
        p.print_help()
        return 2
    try:
        return a.func(a)
    except TrainmemError as e:
        sys.stderr.write(f"trainmem: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
