"""Every name a source file reads is defined, checked from the symbol tables Python's compiler builds (no import, no
GPU). The GPU tests, the GPU benchmarks and the kernels' device paths run only on the GPU machine, so a name left
undefined in them (an edit that reached one function too many) would otherwise wait there to fail as a NameError."""
from __future__ import annotations

import ast
import builtins
import pathlib
import symtable

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("flashgdn", "tests", "benchmarks", "scripts") for p in (ROOT / d).rglob("*.py"))
# what a module has without defining it
MODULE_ATTRIBUTES = {"__file__", "__name__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__",
                     "__path__", "__annotations__"}


def undefined_names(source: str, filename: str) -> list[tuple[str, int, str]]:
    """(scope, its first line, name) for each name read in a scope that resolves to the module's globals (not a local,
    parameter or closure variable) where the module neither binds it (assignment, import, def, class, or a
    ``global`` statement that assigns it) nor has it as a builtin."""
    top = symtable.symtable(source, filename, "exec")
    defined = set(dir(builtins)) | MODULE_ATTRIBUTES
    for sym in top.get_symbols():
        if sym.is_assigned() or sym.is_imported() or sym.is_namespace():
            defined.add(sym.get_name())

    def declared_globals(table):
        for sym in table.get_symbols():
            if sym.is_declared_global() and sym.is_assigned():
                yield sym.get_name()
        for child in table.get_children():
            yield from declared_globals(child)

    defined |= set(declared_globals(top))
    found = []

    def walk(table):
        for sym in table.get_symbols():
            name = sym.get_name()
            if not sym.is_referenced() or name in defined:
                continue
            if table.get_type() == "module" or sym.is_global():
                found.append((table.get_name(), table.get_lineno(), name))
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_the_check_finds_what_it_is_for():
    """An undefined name in a function, a comprehension and a class body is found; parameters, locals, closures,
    imports, names bound by a ``global`` statement and builtins are not."""
    source = (
        "import os\n"
        "from math import pi as PI\n"
        "def f(a, *args, b=1, **kw):\n"
        "    c = a + b + len(args) + PI\n"
        "    def g():\n"
        "        return c + missing_in_closure\n"
        "    return [x + moving for x in kw] + [os.sep]\n"
        "def h():\n"
        "    global LATER\n"
        "    LATER = 1\n"
        "class K:\n"
        "    y = LATER + class_missing\n"
        "print(top_missing)\n"
    )
    names = {name for _, _, name in undefined_names(source, "<check>")}
    assert names == {"missing_in_closure", "moving", "class_missing", "top_missing"}


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_every_name_read_is_defined(path):
    source = path.read_text()
    # a star import binds names the table cannot see (none of the project's sources has one)
    assert not [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
    assert not undefined_names(source, str(path)), undefined_names(source, str(path))
