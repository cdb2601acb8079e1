"""bench/machine.py: the FMA peak (a ceiling our own float32 kernel never exceeds), the read limit."""

import time

import mlx.core as mx
import pagecheck_kernels
import pytest

import impl
from bench.grid import Spec
from fixtures import paged_case


def _prefill_gflops_and_peak(rounds: int = 5) -> tuple[float, float]:
    """(best GFLOP/s of a small causal f32 prefill through the kernel, FLOPs as the grid
    counts them; best FMA peak), measured in turns: a round of each, `rounds` times. Under
    xdist another worker may load the machine for a while; timed one after the other, the
    peak alone once read half its figure (116.8 GFLOP/s on 2 cores, 233 quiet) while the
    prefill ran quiet, and the test failed on noise. In turns, each best comes from the
    quiet rounds of both."""
    heads = dict(q_heads=8, kv_heads=2, head_dim=128)
    case = paged_case(context_lens=[512], query_len=512, page_size=16, dtype="float32", seed=3, **heads)
    flops = Spec("prefill", 1, 512, 16, "float32", 512).flops() * heads["q_heads"] // 32  # grid counts Hq 32
    best, peak = float("inf"), 0.0
    for _ in range(rounds):
        peak = max(peak, pagecheck_kernels.fma_peak_gflops(0.05))
        t0 = time.perf_counter()
        mx.eval(impl.paged_attention(case.query, case.key_pages, case.value_pages, case.block_table,
                                     case.context_lens, case.page_size))
        best = min(best, time.perf_counter() - t0)
    return flops / best / 1e9, peak


def test_fma_peak_is_above_what_the_kernel_reaches():
    achieved, peak = _prefill_gflops_and_peak()
    assert achieved > 0 and peak > achieved, f"FMA peak {peak:.1f} GFLOP/s under the kernel's own {achieved:.1f}"


@pytest.mark.parametrize("seconds", [0.0, -1.0, 61.0, float("nan")])
def test_fma_peak_rejects_bad_durations(seconds):
    with pytest.raises(ValueError, match="seconds must be in"):
        pagecheck_kernels.fma_peak_gflops(seconds)


def test_read_limit_streams_four_times_the_last_level_cache(tmp_path, monkeypatch):
    """The read limit must come from memory, not from a cache it fits in."""
    from bench import machine
    files = []
    for i, size in enumerate(["48K", "32K", "2048K", "307200K"]):
        f = tmp_path / f"index{i}_size"
        f.write_text(size + "\n")
        files.append(str(f))
    monkeypatch.setattr(machine.glob, "glob", lambda pattern: files)
    assert machine.last_level_cache_bytes() == 307200 * 1024
    assert machine.read_bytes() == 4 * 307200 * 1024
    monkeypatch.setattr(machine.glob, "glob", lambda pattern: [])
    assert machine.last_level_cache_bytes() is None and machine.read_bytes() == machine.MIN_READ_BYTES


def test_huge_pages_keeps_values_and_skips_small_buffers():
    """bench.paths.huge_pages only changes how a buffer is mapped, never what it holds."""
    import numpy as np
    from bench import paths
    big = mx.random.normal((3 * (2 << 20) // 4 + 5,), key=mx.random.key(1))
    half = big.astype(mx.bfloat16)
    mx.eval(big, half)
    before = (np.array(big), np.array(half.view(mx.uint16)))
    assert isinstance(paths.huge_pages(big, half), bool)
    assert (np.array(big) == before[0]).all() and (np.array(half.view(mx.uint16)) == before[1]).all()
    small = mx.ones((16,))
    mx.eval(small)
    assert paths.huge_pages(small) is False, "no whole 2 MiB page inside a 64-byte buffer"


def test_read_stream_reads_every_slice_once_per_call():
    """The read the decode cases are timed beside: every element read (a max per thread's
    slice), the whole buffer counted, and closing it frees the buffer and its threads."""
    from bench import machine
    stream = machine.ReadStream(threads=3, nbytes=4 * 1000)
    stream.data[[10, 500, 999]] = [7.0, 8.0, 9.0]
    assert stream.nbytes == 4000
    assert sorted(stream()) == [7.0, 8.0, 9.0]
    stream.close()
    assert stream.data is None


def test_cpu_names_its_family_and_model(monkeypatch, tmp_path):
    """The report's machine line tells Zen 4 from Zen 5 ("AMD EPYC" names both in a VM):
    the model name with /proc/cpuinfo's cpu family and model; the name alone where those
    are missing."""
    from bench import machine

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                       "model name\t: AMD EPYC\n\nprocessor\t: 1\ncpu family\t: 25\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    assert machine._cpu_model() == "AMD EPYC (family 26, model 2)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert machine._cpu_model() == "Some CPU"
