"""``python -m trainmem.cli``."""
from . import main

raise SystemExit(main())
