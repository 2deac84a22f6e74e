"""Let a subpackage be called like the function it is named for.

``trainmem.estimate`` is both the package of formulas and the API function
``trainmem.estimate(model, **options)``; likewise ``trainmem.trace``. Importing a submodule sets the
package attribute on its parent, so a plain function of the same name would be shadowed. The
package's module object is given a ``__call__`` that forwards to the API function instead.

``help(package)`` and ``inspect.signature(package)`` show the function: the module's class gives
it a ``__signature__`` (read first by ``inspect.signature``, CPython ``Lib/inspect.py``,
``_signature_from_callable``) and a ``__doc__`` that adds the function's signature and docstring to
the package's (``pydoc`` documents any module object with ``docmodule``, which prints ``__doc__``;
CPython ``Lib/pydoc.py``, ``TextDoc.docmodule``). Both import the function's module on first use,
so the package itself stays light (``trainmem.trace.api`` needs torch).
"""
from __future__ import annotations

import inspect
import sys
import types
from importlib import import_module
from typing import Any, Callable


def make_callable(module_name: str, target: str) -> None:
    """Make ``sys.modules[module_name]`` callable, forwarding to ``target`` ("pkg.mod:function"),
    with the function's signature and docstring for ``help()`` and ``inspect.signature``."""
    mod_path, fn_name = target.split(":")
    package_doc = sys.modules[module_name].__doc__ or ""
    target_fn: list[Callable[..., Any]] = []

    def function() -> Callable[..., Any]:
        if not target_fn:
            target_fn.append(getattr(import_module(mod_path), fn_name))
        return target_fn[0]

    def doc(self: types.ModuleType) -> str:
        try:
            fn = function()
        except ImportError as e:  # trace without torch: the package's own text and why
            return f"{package_doc}\n\n{fn_name}(...): {target} cannot be imported ({e})"
        call = f"{self.__name__}{inspect.signature(fn)}"
        return f"{package_doc.rstrip()}\n\nCalling the package:\n\n{call}\n\n{inspect.getdoc(fn) or ''}"

    def signature(self: types.ModuleType) -> inspect.Signature:
        try:
            return inspect.signature(function())
        except ImportError as e:  # hasattr() and inspect see "no signature", not an import error
            raise AttributeError(f"{target}: {e}") from None

    class _CallableModule(types.ModuleType):
        __doc__ = property(doc)  # type: ignore[assignment]
        __signature__ = property(signature)

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return function()(*args, **kwargs)

    sys.modules[module_name].__class__ = _CallableModule
