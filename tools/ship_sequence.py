"""Add the replay's layer sequence (``trace.derive._sequence``: each saved tensor of a layer in the
order it is made, and where autocast casts each weight) to shipped derived coefficient sets,
leaving their other fields as they are.

``python tools/ship_sequence.py CASES.json`` takes a list of ``{"model": NAME, "set": [...],
"transformers_version": V, ...estimate options}``; for each it re-derives the set of that setup
with the installed transformers (which must be release V: the traced model is that release's
code), checks the fresh layer totals equal the shipped ones (the same workload), and writes the
shipped file with ``tensors``, ``linears``, ``temps`` and ``events`` added per layer kind.

The H200 runs' sets (``validation/measured``, transformers 5.17.0) were written with that release
beside the installed packages: ``pip install --no-deps --target DIR transformers==5.17.0`` and
``pip install --target DIR "huggingface-hub>=1.5,<2"``, then ``PYTHONPATH=DIR:src python
tools/ship_sequence.py CASES.json``; a case of another release is skipped with a line saying so.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))


def main() -> None:
    warnings.filterwarnings("ignore")
    import transformers
    from trainmem.estimate import derived
    from trainmem.spec.profile import read_cached
    from trainmem.spec.resolve import resolve
    from trainmem.trace.derive import derive_coefficients
    spec_dir = os.path.join(ROOT, "src", "trainmem", "spec", "coefficients")
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    for case in cases:
        case = dict(case)
        name = case.pop("model")
        if case.get("transformers_version") != transformers.__version__:
            print(f"skip {name} {case}: needs transformers {case.get('transformers_version')}")
            continue
        r = resolve(name, **case)
        m, t = r.model, r.training
        k = derived.key(m, t)
        path = os.path.join(spec_dir, f"{k}.json")
        shipped = read_cached("coefficients", k)
        if shipped is None or not os.path.exists(path):
            print(f"skip {name} {case}: no shipped set {k}")
            continue
        fresh = derive_coefficients(m, derived._canonical(t, m), derived.regime(m, t), derived.batch1(m, t))
        for kind, v in fresh["kinds"].items():
            old = shipped["kinds"][kind]
            assert abs(old["tok"] - v["tok"]) <= 1e-6 * max(1.0, abs(v["tok"])), (name, kind, old["tok"], v["tok"])
            for field in ("tensors", "linears", "temps", "events"):
                if field in v:
                    old[field] = v[field]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(shipped, f, sort_keys=True, separators=(",", ":"))
            f.write("\n")
        print(f"{name} {case}: {k} ({', '.join(str(len(v.get('tensors', []))) for v in shipped['kinds'].values())} "
              f"tensors)", flush=True)


if __name__ == "__main__":
    main()
