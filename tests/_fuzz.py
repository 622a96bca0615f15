"""Hypothesis strategies shared by the HTTP fuzz tests (the gateway and dew serve)."""

from __future__ import annotations

from hypothesis import strategies as st

# Any JSON value, NaN and infinities included, nested a little: what a field may be
# sent as instead of its own type.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
