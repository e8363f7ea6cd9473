"""Import-only modules for SGLang on a CPU test machine: every name resolves, nothing computes.

SGLang imports `sgl_kernel` (its CPU branches, at module level) and `torchvision` (multimodal
configs) even for text models; PyPI has no CPU build of either that fits torch 2.13.0's CPU
wheel. Any call into them raises, so a test that passes computed nothing with them.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class Unavailable(type):
    """A name from an import-only module: attributes chain, calling it raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Unavailable(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__name__} is import-only on this CPU test machine")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package):
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        make_import_only(module)


def make_import_only(module: types.ModuleType) -> None:
    """Turn `module` (a package) into one whose names and submodules all resolve."""
    module.__path__ = []
    module.__version__ = "0"  # transformers parses it; 0 is below every version it asks for
    module.__getattr__ = lambda name: Unavailable.__getattr__(Unavailable(module.__name__, (), {}), name)
    if not module.__name__.count("."):
        sys.meta_path.append(_Finder(module.__name__))
