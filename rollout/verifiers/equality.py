"""Equality the answer cannot fake: a code task's ``assert result == expected`` compared by a
helper the answer did not write.

The trick (issue 34): an answer returns an object whose ``__eq__`` is always true, so ``assert f(x)
== y`` passes whatever ``f`` computes. The tests' source is trusted (it comes with the task), the
answer's code is not; so the tests' asserts are rewritten, before the program is put together, from
``assert a == b`` to ``assert <helper>(a, b)``. The helper, defined before the answer runs (so it
holds the real builtins), says equal only for values whose comparison no code of the answer
decides: plain data (numbers, strings, bytes, None and containers of them, exact types), or
instances of classes the submitted program did not define (``Fraction``, ``Decimal``, a
``namedtuple``, numpy's arrays), compared by their own ``==``. An object of a class the answer
defined (a subclass of ``int`` included) is equal to nothing.

The helper's name is new each run. Like the pass marker, it is out of the answer's reach only as
long as the answer does not read its own program out of memory.
"""

from __future__ import annotations

import ast

# Defined first in the program: ``{name}`` is the helper's name for this run. Functions and classes
# the program defines come from "<stdin>" (the sandbox reads the program there).
PRELUDE = """
def {name}(a, b, _type=type, _isinstance=isinstance, _getattr=getattr, _all=all, _bool=bool):
    _plain = (int, float, complex, bool, str, bytes, type(None))
    _seqs = (list, tuple, set, frozenset)
    _builtin = ("wrapper_descriptor", "method_descriptor", "builtin_function_or_method")

    def trusted(v, depth):
        t = _type(v)
        if t in _plain:
            return True
        if depth > 64:
            return False
        for c in t.__mro__:
            for attr in ("__eq__", "__ne__", "__hash__", "__iter__", "__len__", "__bool__"):
                f = c.__dict__.get(attr)
                if f is None or _type(f).__name__ in _builtin:
                    continue
                code = _getattr(f, "__code__", None)
                if code is None or code.co_filename == "<stdin>":
                    return False
        if _isinstance(v, dict):
            return _all(trusted(k, depth + 1) and trusted(x, depth + 1) for k, x in v.items())
        if _isinstance(v, _seqs):
            return _all(trusted(x, depth + 1) for x in v)
        return True

    return trusted(a, 0) and trusted(b, 0) and _bool(a == b)
"""


class _StrictAsserts(ast.NodeTransformer):
    def __init__(self, helper: str) -> None:
        self.helper = helper

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            call = ast.Call(ast.Name(self.helper, ast.Load()), [test.left, test.comparators[0]], [])
            node.test = ast.copy_location(call, test)
        return node


def strict_asserts(tests: str, helper: str) -> str:
    """``tests`` with every ``assert a == b`` made ``assert helper(a, b)``; unchanged if it does not
    parse (it then fails as it would have)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError:
        return tests
    return ast.unparse(ast.fix_missing_locations(_StrictAsserts(helper).visit(tree))) + "\n"
