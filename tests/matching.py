"""Comparing recorded outputs (the golden tests): every token, count, text and finish exactly;
floats — log-probabilities — to 1e-4. Neither of these is a change of behaviour, and a changed
token still fails: fp32 kernels differ between CPUs in the last bits (measured: 1.8e-8 relative
on the Markov fakes' logprobs, an AVX2-only AMD EPYC against the recording machine), and every
row is normalised in float64 before it is used (an fp32 row of the built-in model's 49,152
entries sums to 1 ± 3e-5, which moved a logprob by 2.9e-5).
"""

from __future__ import annotations

import math
from typing import Any

ABSOLUTE = 1e-4  # on log-probabilities: a probability moved by 0.01 %


def matches(actual: Any, expected: Any) -> bool:
    """``actual == expected`` with floats compared to ``ABSOLUTE``."""
    if isinstance(expected, float) and isinstance(actual, (int, float)) and not isinstance(actual, bool):
        return math.isclose(actual, expected, rel_tol=0.0, abs_tol=ABSOLUTE)
    if isinstance(expected, list) and isinstance(actual, list):
        return len(actual) == len(expected) and all(matches(a, e) for a, e in zip(actual, expected))
    if isinstance(expected, dict) and isinstance(actual, dict):
        return actual.keys() == expected.keys() and all(matches(actual[k], expected[k]) for k in expected)
    return bool(actual == expected)
