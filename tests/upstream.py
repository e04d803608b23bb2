"""Import submodules of upstream's ``stepaudio2`` (minicpmo-utils) as an independent reference.

The package ``__init__`` imports torchaudio and s3tokenizer (not installed here), so we
register empty package modules with the right ``__path__`` and import submodules
directly. Tests that need upstream are skipped when minicpmo-utils is absent.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest


def upstream_root() -> Path:
    spec = importlib.util.find_spec("stepaudio2") if "stepaudio2" not in sys.modules else None
    if "stepaudio2" in sys.modules:
        return Path(list(sys.modules["stepaudio2"].__path__)[0])
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("minicpmo-utils (upstream stepaudio2 reference) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def import_upstream(module_name: str):
    """Import ``stepaudio2.<...>`` without running any package ``__init__`` above it."""
    root = upstream_root()
    parts = module_name.split(".")
    if parts[0] != "stepaudio2":
        raise ValueError(f"{module_name}: not a stepaudio2 module")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg in sys.modules:
            continue
        path = root.joinpath(*parts[1:i])
        if not path.is_dir():
            pytest.skip(f"upstream package {pkg} not found under {root}")
        mod = types.ModuleType(pkg)
        mod.__path__ = [str(path)]
        sys.modules[pkg] = mod
        if i > 1:  # parent.child attribute, as a real import sets it (pydoc.locate needs it)
            setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], mod)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        pytest.skip(f"cannot import upstream {module_name}: {exc}")


def upstream_source(relative: str) -> str:
    """Text of an upstream source file (e.g. ``token2wav.py``) for code we cannot import."""
    path = upstream_root() / relative
    if not path.is_file():
        pytest.skip(f"upstream file {path} not found")
    return path.read_text()


def upstream_function(relative: str, qualname: str, namespace: dict):
    """Compile one function (``name`` or ``Class.method``) from an upstream source file.

    For reference code whose module cannot be imported here (``token2wav.py`` imports
    torchaudio and s3tokenizer); ``namespace`` supplies the globals it uses.
    """
    import ast

    tree = ast.parse(upstream_source(relative))
    scope: list = tree.body
    *outer, name = qualname.split(".")
    for cls in outer:
        node = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if node is None:
            pytest.skip(f"upstream {relative} has no class {cls}")
        scope = node.body
    fn = next((n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        pytest.skip(f"upstream {relative} has no function {qualname}")
    fn.decorator_list = []
    module = ast.Module(body=[fn], type_ignores=[])
    glb = dict(namespace)
    exec(compile(module, f"<upstream {relative}:{qualname}>", "exec"), glb)
    return glb[name]
