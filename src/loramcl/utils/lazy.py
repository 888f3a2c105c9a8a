"""PEP 562 lazy exports: a package's public names import their module on first use, so that `loramcl --help` and
`import loramcl.metrics` do not pay for torch and transformers."""

from __future__ import annotations

import importlib


def lazy_exports(namespace: dict, exports: dict[str, str]):
    """The module-level ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``;
    ``exports`` maps each public name to the module that defines it."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__
