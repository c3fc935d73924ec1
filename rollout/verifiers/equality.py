"""Equality the answer cannot fake: a code task's ``assert result == expected`` compared by a
helper the answer did not write.

The trick (issue 34): an answer returns an object whose ``__eq__`` is always true (its own class,
a subclass of ``int``, ``unittest.mock.ANY``, a builtin such as ``id`` as ``__eq__``), so ``assert
f(x) == y`` passes whatever ``f`` computes. The tests' source is trusted (it comes with the task),
the answer's code is not; so the tests' asserts are rewritten from ``assert a == b`` to ``assert
<helper>(a, b)``, and the tests are compiled under a file name of their own (new each run). The
helper, defined before the answer runs (so it holds the real builtins and the standard classes'
own methods), says equal only when both values are

- plain data: numbers, strings, bytes, None, and lists, tuples (namedtuples too), dicts and sets
  of plain data, of exactly those types;
- ``Fraction``, ``Decimal`` or ``datetime`` values of exactly those types, whose ``__eq__`` is still
  the standard one; or
- instances of classes the task's tests define (a ``ListNode`` of theirs), every comparison method
  of which the tests wrote;

and then compares them with their own ``==``. Anything else, whatever its ``__eq__`` says, is
equal to nothing.

What it does not stop: an answer that reads its own program out of memory (the helper's name and
the tests' file name are in it) can rebind the helper, as it could print the pass marker itself.
Nor asserts of other shapes (``assertEqual``, ``a != b``, ``abs(a - b) < e``).
"""

from __future__ import annotations

import ast

# Defined first in the program; ``{name}`` is the helper's name, ``{tests}`` the tests' file name.
PRELUDE = """
import datetime as _rm_dt, decimal as _rm_dec, fractions as _rm_fr
def {name}(a, b, _type=type, _isinstance=isinstance, _getattr=getattr, _all=all, _bool=bool, _hasattr=hasattr,
           _std={{c: (c.__dict__.get("__eq__"), c.__dict__.get("__ne__")) for c in (_rm_fr.Fraction, _rm_dec.Decimal,
                 _rm_dt.date, _rm_dt.datetime, _rm_dt.time, _rm_dt.timedelta)}}):
    plain = (int, float, complex, bool, str, bytes, type(None))
    compared = ("__eq__", "__ne__", "__hash__", "__iter__", "__len__", "__bool__", "__getitem__", "__contains__")

    def tests_own(t):
        for c in t.__mro__[:-1]:  # all but object
            for attr in compared:
                f = c.__dict__.get(attr)
                code = _getattr(f, "__code__", None)
                if f is not None and (code is None or code.co_filename != {tests!r}):
                    return False
        return True

    def trusted(v, depth):
        t = _type(v)
        if t in plain:
            return True
        if depth > 64:
            return False
        if t in (list, tuple, set, frozenset) or (
            t.__bases__ == (tuple,) and _hasattr(t, "_fields") and not any(a in t.__dict__ for a in compared)
        ):
            return _all(trusted(x, depth + 1) for x in v)
        if t is dict:
            return _all(trusted(k, depth + 1) and trusted(x, depth + 1) for k, x in v.items())
        if t in _std:
            return (t.__dict__.get("__eq__"), t.__dict__.get("__ne__")) == _std[t]
        return tests_own(t)

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


def run_tests(tests: str, filename: str) -> str:
    """Program text that runs ``tests`` compiled as ``filename``, in the program's own namespace: the
    classes they define are known apart from the answer's."""
    return f"exec(compile({tests!r}, {filename!r}, 'exec'), globals())\n"
