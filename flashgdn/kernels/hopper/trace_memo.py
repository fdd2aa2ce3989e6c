"""TileLang's rewrite of a macro or prim_func, done once per function instead of once per kernel built.

Every factory here defines its ``@T.macro`` and ``@T.prim_func`` functions inside its body, so each configuration
built runs TileLang's decorators afresh. For each function they read its source, parse it, rewrite the tree
(``DSLMutator``: Python control flow into IR builder calls), unparse it and compile it into a ``make_closure``
that takes the function's closure variables. That is most of what loading a kernel from the disk cache costs:
TileLang must trace the program to find its cache entry, and 168 of the 178 decorations of the 10 serving kernels
of one head configuration are macros (0.3 s a kernel in all, 70% of it the rewrite; notes "Kernels loaded ahead of
the first step measured").

The rewrite depends on the function's code and, through ``DSLMutator._try_eval``, on the values of the few
expressions it evaluates (annotations such as ``T.float32`` or ``T.Tensor``, and the callee of each ``with``
statement, to find the kernel launch). So the memo keeps, per code object, closure names and globals, the compiled
``make_closure`` with the expressions evaluated and their results. A later decoration of the same function calls
that ``make_closure`` with its own closure values, after evaluating the recorded expressions again: if any gives
something else, the function is rewritten afresh (and the memo takes the new rewrite). The IR built is the same
either way, and so are the kernels' cache keys (``tests/test_trace_memo.py`` compares the TVMScript of every
variant of a head configuration built with and without the memo).

Only for the pinned TileLang (0.1.15), whose private ``mutate`` this replaces; ``FLASHGDN_TRACE_MEMO=0`` leaves
TileLang as it is.
"""
from __future__ import annotations

import os
import threading

#: The TileLang release whose ``tilelang.language.eager.ast.mutate`` this module knows.
TILELANG_VERSION = "0.1.15"

_lock = threading.Lock()
_installed = False
_memo: dict = {}  # (code, closure names, id(globals)) -> (make_closure, [(expr text, value)], type hints, source)
_original: dict = {}  # TileLang's own mutate, while the memo stands in for it
stats = {"rewrites": 0, "reuses": 0}


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - an IR value whose == builds an expression: not provably the same
        return False


def _evaluate(text: str, nonlocals: dict, globals_: dict):
    """What ``DSLMutator._try_eval`` gives for an expression's text under these closure values and globals."""
    from tilelang.language.eager import ast as tl_ast

    try:
        return eval("lambda " + ",".join(nonlocals) + ": " + text, globals_)(**nonlocals)
    except Exception:  # noqa: BLE001 - TileLang's own answer to an expression it cannot evaluate
        return tl_ast._empty


def _memo_mutate(func):
    """``tilelang.language.eager.ast.mutate`` with the rewrite kept per function (module docstring)."""
    import ast
    import inspect
    from pathlib import Path

    from tilelang.language.eager import ast as tl_ast
    from tilelang.language.eager import utils

    nonlocals = utils.get_func_nonlocals(func)
    key = (func.__code__, tuple(nonlocals), id(func.__globals__))
    entry = _memo.get(key)
    if entry is not None:
        make_closure, evaluated, type_hints, source = entry
        if all(_same(_evaluate(text, nonlocals, func.__globals__), value) for text, value in evaluated):
            stats["reuses"] += 1
            return tl_ast.IRGenerator(gen=make_closure(**nonlocals), source=source, extra_type_hints=dict(type_hints))

    evaluated = []

    class RecordingMutator(tl_ast.DSLMutator):
        def _try_eval(self, node):
            value = super()._try_eval(node)
            evaluated.append((ast.unparse(node), value))  # the text: the rewrite goes on to change the nodes
            return value

    # the same steps as TileLang's mutate, with the mutator's evaluations recorded
    tree = utils.get_ast(func)
    filename = inspect.getsourcefile(func) or inspect.getfile(func)
    mutator = RecordingMutator(nonlocals, func.__globals__, str(Path(filename).absolute()))
    tree = mutator.visit(tree)
    make_closure = utils.get_compiled_object(tree, "make_closure", filename, func.__globals__)
    source = ast.unparse(tree)
    with _lock:
        _memo[key] = (make_closure, evaluated, dict(mutator.extra_type_hints), source)
    stats["rewrites"] += 1
    return tl_ast.IRGenerator(gen=make_closure(**nonlocals), source=source,
                              extra_type_hints=mutator.extra_type_hints)


def install() -> bool:
    """Put the memo in TileLang's decorators (idempotent). True where it is in place."""
    global _installed
    if _installed:
        return True
    if os.environ.get("FLASHGDN_TRACE_MEMO", "1") == "0":
        return False
    with _lock:
        if _installed:
            return True
        try:
            import tilelang
            from tilelang.language.eager import ast as tl_ast
            from tilelang.language.eager import builder as tl_builder
        except Exception:  # noqa: BLE001 - no TileLang, or laid out otherwise: nothing to memoise
            return False
        if (tilelang.__version__ != TILELANG_VERSION or getattr(tl_builder, "mutate", None) is not tl_ast.mutate
                or not hasattr(tl_ast.DSLMutator, "_try_eval") or not hasattr(tl_ast, "_empty")):
            return False
        _original["mutate"] = tl_ast.mutate
        tl_ast.mutate = tl_builder.mutate = _memo_mutate
        _installed = True
    return True


def uninstall() -> None:
    """TileLang's own ``mutate`` back, and the memo emptied (the tests compare builds with and without it)."""
    global _installed
    with _lock:
        if not _installed:
            return
        from tilelang.language.eager import ast as tl_ast
        from tilelang.language.eager import builder as tl_builder

        tl_ast.mutate = tl_builder.mutate = _original.pop("mutate")
        _memo.clear()
        _installed = False
