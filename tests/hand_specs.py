"""Hand-fixture specs written inside a test: fixtures/hand.py reads fixtures/data/*.json,
and these helpers point it at a temporary folder for one spec (the loader's own tests)."""

from __future__ import annotations

import json

DROP = object()  # a key to leave out


def spec_with(base: dict, **changes) -> dict:
    """A copy of `base` with top-level changes; `r0_KEY=...` changes request 0's KEY, and a
    value of DROP leaves the key out."""
    spec = json.loads(json.dumps(base))
    for key, value in changes.items():
        if key.startswith("r0_"):
            spec["requests"][0][key[3:]] = value
        else:
            spec[key] = value
    spec = {k: v for k, v in spec.items() if v is not DROP}
    spec["requests"][0] = {k: v for k, v in spec["requests"][0].items() if v is not DROP}
    return spec


def load_spec(tmp_path, monkeypatch, spec: dict):
    """The Case fixtures.hand builds from `spec` (its cache cleared before and after)."""
    from fixtures import hand

    (tmp_path / "tmp.json").write_text(json.dumps(spec))
    monkeypatch.setattr(hand, "DATA", tmp_path)
    hand._file.cache_clear()
    try:
        return hand.hand_case("tmp")
    finally:
        hand._file.cache_clear()
