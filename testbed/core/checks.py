"""Checks of a single configuration value (scenario fields, profile figures): each returns
None when the value is fine, else the reason it is not, for a one-line error."""


def positive(v):
    return None if v > 0 else "must be > 0"


def non_negative(v):
    return None if v >= 0 else "must be >= 0"


def fraction(v):
    return None if 0 <= v <= 1 else "must be between 0 and 1"


def percentile(v):
    return None if 0 <= v <= 100 else "must be between 0 and 100"


def efficiency(v):
    return None if 0 < v <= 1 else "must be in (0, 1]"


def between(lo: float, hi: float):
    """A check that a value lies in [lo, hi]."""
    def check(v):
        return None if lo <= v <= hi else f"must be between {lo:g} and {hi:g}"
    return check
