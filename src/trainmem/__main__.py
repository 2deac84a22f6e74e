"""``python -m trainmem``: the command line, for a source checkout run without installing
(``PYTHONPATH=src python3 -m trainmem ...``, as ``make gpu-validate`` does on a GPU machine)."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
