"""A faster Triton CPU interpreter for the test suite: the same semantics, less introspection.

Triton's interpreter, before running a ``@triton.jit`` function, swaps every builtin of
``triton.language`` (and of ``tl.tensor``, ``tl.math``, the tensor descriptor) for an interpreter
version. It finds them with ``inspect.getmembers`` over each module, on every kernel launch AND on every
call of a nested ``@jit`` helper inside a running program (Triton 3.x ``_patch_builtin``). The kernels
here call small helpers in loops, so the scans ran ~45,000 times in one block-kernel test and took about a
fifth of its time. The set of builtin NAMES of a module never changes, so this shim scans each module once
and afterwards visits only those names, patching each one that is still a builtin at that moment: exactly
what the scan would do (inside a launch the outer patch has already replaced them, and nothing is done).

It also turns off the interpreter's integer-overflow sanitizer (``InterpreterOptions.sanitize_overflow``,
on by default there): every int32 add, sub and mul of index arithmetic was redone in int64 and compared
against the int32 range, ~40% of a kernel test's time. Compiled kernels run without it (Triton ties it to
``debug``, off by default), and the tests' tiny shapes keep every index far below 2**31.

Applied by ``conftest.py`` only when the interpreter is on; a Triton whose internals have another shape
is left alone (the tests then run at the old speed).
"""

from __future__ import annotations

import dataclasses
import inspect


def install() -> bool:
    """Install the shim; True when it was installed (or already was)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:       # no Triton, or one without the interpreter module
        return False
    orig = getattr(ti, "_patch_builtin", None)
    if getattr(orig, "_scan_once", False):
        return True
    patch_attr = getattr(ti, "_patch_attr", None)
    is_builtin = getattr(getattr(getattr(ti, "tl", None), "core", None), "is_builtin", None)
    if orig is None or patch_attr is None or is_builtin is None or \
            list(inspect.signature(orig).parameters) != ["pkg", "builder", "scope"]:
        return False
    names: dict[int, tuple[object, list[str]]] = {}

    def patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            # first sight of this module: it is not patched yet (the first kernel launch patches first)
            known = names[id(pkg)] = (pkg, [n for n, m in inspect.getmembers(pkg) if is_builtin(m)])
        for name in known[1]:
            member = getattr(pkg, name)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin._scan_once = True
    ti._patch_builtin = patch_builtin
    builder = getattr(ti, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if dataclasses.is_dataclass(opts) and getattr(opts, "sanitize_overflow", False):
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)
    return True
