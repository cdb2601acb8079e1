"""The cached twin of a decode from DRAM (bench/cached.py), timed in its turns by the
report, and the DRAM goal's profile built from it (bench/goals.py `_dram_profile`)."""

import pytest

from bench import cached, goals, grid, machine, report


def _spec(batch, context, page_size, dtype, op="decode"):
    return grid.Spec(op, batch, context, page_size, dtype, 1 if op == "decode" else context)


@pytest.mark.parametrize("page_size, dtype, context", [(16, "float32", 256), (16, "bfloat16", 512),
                                                       (128, "float32", 256), (128, "bfloat16", 512)])
def test_twin_holds_8_mib_of_kv_in_whole_pages(page_size, dtype, context):
    twin = cached.twin(_spec(16, 32768, page_size, dtype))
    assert twin == grid.Spec("decode", 4, context, page_size, dtype, 1)
    kv = 2 * twin.batch * twin.context * grid.SHAPE["kv_heads"] * grid.SHAPE["head_dim"] * grid.ITEMSIZE[dtype]
    assert kv == 8 << 20


def test_twin_bad_inputs():
    with pytest.raises(ValueError, match="a cached twin is a decode's; got a prefill spec prefill-B1-S512"):
        cached.twin(_spec(1, 512, 16, "float32", op="prefill"))
    with pytest.raises(ValueError, match="pages of 512 float32 keys do not fit 8388608 bytes of K/V"):
        cached.twin(_spec(4, 8192, 512, "float32"))


def test_report_times_the_twin_beside_decodes_from_dram_only(monkeypatch):
    """A decode that reads at least the stream's bytes gets its twin's rate, timed in its
    turns, on its serving path's row (the twin runs that path); a smaller decode, and a
    mixed batch of the same size, do not."""
    big, small = _spec(4, 128, 16, "float32"), _spec(1, 128, 16, "float32")
    mixed = grid.Spec("mixed", 4, 128, 16, "float32", grid.MIXED_L)
    monkeypatch.setattr(grid, "attention_specs", lambda level: [big, small, mixed])
    monkeypatch.setattr(machine, "read_bytes", lambda: 2 * 10 ** 6)
    assert small.io_bytes() < 2 * 10 ** 6 <= big.io_bytes()
    rows = report.attention_cases("smoke", log=lambda _: None)
    timed = [r for r in rows if "median_s" in r]
    with_twin = {(r["batch"], r["op"], r["path"]) for r in timed if "cached_gbytes_per_s" in r}
    assert with_twin == {(4, "decode", "paged_now")}, "the serving path's row only"
    for r in timed:
        if "cached_gbytes_per_s" in r:
            assert r["cached_gbytes_per_s"] > 0 and r["cached_case"] == "decode-B4-S256-ps16-float32"
        else:
            assert "cached_case" not in r


def _dram(gbps, read, twin=None, dtype="bfloat16"):
    c = {"op": "decode", "path": "paged_now", "batch": 16, "context": 32768, "page_size": 16, "dtype": dtype,
         "median_s": 1.0, "bytes": 10 ** 9, "gbytes_per_s": gbps, "read_gbytes_per_s": read,
         "bandwidth_fraction": gbps / read}
    if twin is not None:
        c.update(cached_gbytes_per_s=twin, cached_case="decode-B4-S512-ps16-bfloat16")
    return c


def _dram_goal(*cases):
    return next(g for g in goals.evaluate({"cases": list(cases), "limits": {"read_bytes": 2.56e8}})
                if g["goal"] == goals.DRAM_GOAL)


def test_a_missed_dram_goal_says_how_much_arithmetic_it_hid():
    goal = _dram_goal(_dram(30.0, 40.0, twin=80.0))
    assert goal["met"] is False and goal["measured"] == 0.75
    assert goal["detail"] == (
        "worst B16 S32768 ps16 bfloat16; there paged_now read 30.0 GB/s against the 40.0 GB/s read stream timed "
        "beside it; its loops from cache (decode-B4-S512-ps16-bfloat16, in the same turns) 80.0 GB/s: memory and "
        "arithmetic one after the other would read 26.7, fully overlapped 40.0; it hid 33% of its arithmetic under "
        "the memory's time; 90% of the stream needs 78% hidden")
    none_hidden = _dram_goal(_dram(20.0, 40.0, twin=40.0))["detail"]
    assert "one after the other would read 20.0, fully overlapped 40.0; it hid 0% of its arithmetic" in none_hidden
    assert none_hidden.endswith("90% of the stream needs 89% hidden")


def test_a_missed_dram_goal_bound_by_its_arithmetic_says_so():
    detail = _dram_goal(_dram(20.0, 40.0, twin=30.0))["detail"]
    assert detail.endswith("it hid 25% of its arithmetic under the memory's time, and its loops alone read below "
                           "90% of the stream: bound by its arithmetic")
    assert "needs" not in detail


def test_dram_profile_only_where_missed_and_says_when_no_twin():
    detail = _dram_goal(_dram(20.0, 40.0))["detail"]
    assert detail == ("worst B16 S32768 ps16 bfloat16; there paged_now read 20.0 GB/s against the 40.0 GB/s read "
                      "stream timed beside it; its loops from cache not timed (no cached twin in its turns)")
    met = _dram_goal(_dram(38.0, 40.0, twin=30.0))
    assert met["met"] is True and met["detail"] == "worst B16 S32768 ps16 bfloat16"
    worst = _dram_goal(_dram(38.0, 40.0, twin=30.0, dtype="float32"), _dram(20.0, 40.0, twin=80.0))
    assert worst["detail"].startswith("worst B16 S32768 ps16 bfloat16; median 72% over 2 cases; worst per dtype: "
                                      "float32 95%, bfloat16 50%; there paged_now read 20.0 GB/s")
    assert ("one after the other would read 26.7, fully overlapped 40.0; it ran slower than the two one after the "
            "other, hiding none of its arithmetic; 90% of the stream needs 78% hidden") in worst["detail"]
