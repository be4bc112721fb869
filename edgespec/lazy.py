"""Lazy re-exports for a package's __init__: each name imported from its module on first use.

    __getattr__, __dir__ = lazy_exports(__name__, {"Engine": "edgespec.engine", ...}, globals())

so importing the package (which every `import package.sub` does) loads none of them.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """The module-level `__getattr__` and `__dir__` of `package` for `exports` (name -> module)."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later look-ups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
