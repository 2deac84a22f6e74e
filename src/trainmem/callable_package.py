"""Let a subpackage be called like the function it is named for.

``trainmem.estimate`` is both the package of formulas and the API function
``trainmem.estimate(model, **options)``; likewise ``trainmem.trace``. Importing a submodule sets the
package attribute on its parent, so a plain function of the same name would be shadowed. The
package's module object is given a ``__call__`` that forwards to the API function instead.
"""
from __future__ import annotations

import sys
import types
from importlib import import_module


def make_callable(module_name: str, target: str) -> None:
    """Make ``sys.modules[module_name]`` callable, forwarding to ``target`` ("pkg.mod:function")."""
    mod_path, fn_name = target.split(":")

    target_fn: list = []

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            if not target_fn:
                target_fn.append(getattr(import_module(mod_path), fn_name))
            return target_fn[0](*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
