"""SGLang's own request classes, imported without CUDA or torchvision, to validate what the
SGLang backend sends.

``sglang.srt.managers.io_struct`` pulls in modules that import ``torchvision`` at import
time (image preprocessing for multimodal models). torchvision is not installed here, so a
stub package answers those imports; it is put in place only after ``transformers`` has
recorded that torchvision is unavailable, so transformers never tries to use it.
``load()`` returns None when SGLang is not installed (the tests that need it skip).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Anything:
    """Stands in for any torchvision attribute: callable, subscriptable, an attribute bag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __class_getitem__(cls, item: Any) -> type[_Anything]:
        return cls

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_loaded: types.SimpleNamespace | None = None


def load() -> types.SimpleNamespace | None:
    """``io_struct`` and ``sampling_params`` of the installed SGLang, or None without it."""
    global _loaded
    if _loaded is not None:
        return _loaded
    try:
        import sglang  # noqa: F401  (only whether it is there; importing it runs little)
    except ImportError:
        return None
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached as False before the stub exists
    finder = None
    if "torchvision" not in sys.modules:
        finder = _StubFinder()
        sys.meta_path.insert(0, finder)
    try:
        from sglang.srt.managers import io_struct
        from sglang.srt.sampling import sampling_params
    finally:
        # Only SGLang's import sees the stub finder; the stub modules it made stay cached.
        if finder is not None:
            sys.meta_path.remove(finder)

    _loaded = types.SimpleNamespace(io_struct=io_struct, sampling_params=sampling_params)
    return _loaded
