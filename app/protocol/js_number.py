"""JavaScript's ``Number.prototype.toString`` for Python floats.

The canonical JSON of a message must match what zero-cache (Node) writes, and JS
prints numbers differently from Python: ``1.0`` is ``1``, ``1e21`` is ``1e+21``,
``1e16`` is ``10000000000000000``, ``1e-7`` is ``1e-7`` but ``1e-6`` is
``0.000001``.  Both languages pick the same *digits* (the shortest string that
round-trips, ties broken towards the closest value), so we take the digits from
``repr`` and only redo the layout, following ECMA-262 Number::toString:
with ``k`` significant digits and decimal exponent ``n`` (value = 0.d1..dk x 10^n),

* ``k <= n <= 21``   -> digits followed by ``n - k`` zeros
* ``0 < n <= 21``    -> digits with a decimal point after the n-th
* ``-6 < n <= 0``    -> ``0.`` then ``-n`` zeros then the digits
* otherwise          -> ``d[.ddd]e+X`` / ``d[.ddd]e-X``
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["format_js_number"]

# Integral floats below 2^53 are exact as Python ints, and str(int) is the fast path.
_EXACT_INT_LIMIT: Final = 2.0**53


def format_js_number(x: float) -> str:
    """Format a finite float exactly as JavaScript's ``String(x)`` does.

    NaN and infinities have no JSON representation (JS would write ``null``);
    they raise :class:`ValueError` instead of being silently turned into null.
    """
    if not math.isfinite(x):
        raise ValueError(f"{x!r} is not a valid JSON number (NaN and Infinity are rejected)")
    if x == 0.0:
        return "0"  # also -0.0: JS prints "0"
    if -_EXACT_INT_LIMIT < x < _EXACT_INT_LIMIT and x.is_integer():
        return str(int(x))

    r = repr(float(x))
    sign = ""
    if r[0] == "-":
        sign = "-"
        r = r[1:]
    mantissa, _, exp = r.partition("e")
    int_part, _, frac_part = mantissa.partition(".")
    digits = int_part + frac_part
    n = len(int_part) + (int(exp) if exp else 0)
    stripped = digits.lstrip("0")
    n -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    k = len(digits)

    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    e = n - 1
    head = digits[0] if k == 1 else digits[0] + "." + digits[1:]
    return f"{sign}{head}e{'+' if e >= 0 else '-'}{abs(e)}"
