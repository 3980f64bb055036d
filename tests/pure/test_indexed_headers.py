"""`gateway.request.IndexedHeaders` reads a request's headers as Starlette's `Headers` does (the hot
path's requests use it: `gateway.hot_paths.dispatch`), for any head: the same value by any case of
a name, the first of a repeated header, absent names and `getlist` alike."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from gateway.request import IndexedHeaders

NAMES = st.sampled_from(["authorization", "x-priority", "x-stainless-read-timeout", "x-api-key", "content-type"])
VALUES = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8)


@given(st.lists(st.tuples(NAMES, VALUES), max_size=8), NAMES)
def test_reads_as_starlettes_headers(head: list[tuple[str, str]], name: str) -> None:
    scope = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in head]}
    ours, theirs = IndexedHeaders(scope=scope), Headers(scope=scope)
    for n in (name, name.upper(), name.title()):
        assert ours.get(n) == theirs.get(n)
        assert ours.get(n, "unsaid") == theirs.get(n, "unsaid")
        assert (n in ours) == (n in theirs)
        assert ours.getlist(n) == theirs.getlist(n)
        if n in theirs:
            assert ours[n] == theirs[n]
    assert dict(ours) == dict(theirs)
