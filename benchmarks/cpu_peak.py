r"""The CPU's measured peak for model FLOPs utilisation: how many multiply-adds a second its vector units retire when
nothing but independent multiply-adds run, on as many threads as torch uses.

A clock-based estimate (cores x GHz x FLOPs a cycle) needs the clock a core runs at under load, which
``/proc/cpuinfo`` does not give (on the AMD EPYC of these benchmarks it reads 2.6 GHz; the cores boost to about
3.6): MFU against it is overstated. This script compiles a loop of independent multiply-adds with the system's C++
compiler (16 accumulators, more than the instructions' latency x throughput) into a temporary directory, runs it on
``threads`` OpenMP threads, and reports the rate of each kind the CPU has:

    fp32   vfmadd231ps on 512-bit registers (256-bit where the CPU lacks AVX-512)   1 multiply-add a lane
    bf16   vdpbf16ps (AVX512-BF16)                                                  2 multiply-adds a float32 lane
    int8   vpdpbusd (AVX512-VNNI), u8 x s8 into int32                               4 multiply-adds an int32 lane

    amx_bf16  tdpbf16ps on AMX tiles (Intel Sapphire Rapids and later)   16 x 16 x 32 multiply-adds a tile product
    amx_int8  tdpbusd on AMX tiles, u8 x s8 into int32                   16 x 16 x 64 multiply-adds a tile product

(the tile loops: six accumulator tiles, each updated in turn from the same two operand tiles). The bf16 rate is
the ceiling of a bf16 model (``amx_bf16`` where the CPU has AMX, else ``bf16``); the int8 rate that of int8
products (``amx_int8``, else ``int8``).

    PYTHONPATH=src:benchmarks python benchmarks/cpu_peak.py --out outputs/bench/cpu-peak.json
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from common import cpu_facts, markdown_table, output_file, write_json

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

// One thread's loop: 16 independent accumulators, each updated ITERS times; returns a value that depends on them all
// (so the compiler keeps the work). The operand passes through an empty asm once an iteration, so it is not hoisted.
#define LOOP(Acc, zero, operand, step)                                                                        \
    {                                                                                                         \
        Acc acc[16];                                                                                          \
        for (int i = 0; i < 16; i++) acc[i] = zero;                                                           \
        for (long t = 0; t < iters; t++) {                                                                    \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) acc[i] = step;                              \
            asm volatile("" : "+v"(operand));                                                                 \
        }                                                                                                     \
        for (int i = 0; i < 16; i++) { float f[sizeof(Acc) / 4]; std::memcpy(f, &acc[i], sizeof f); sink += f[0]; } \
    }

int main(int argc, char **argv) {
    const char *kind = argv[1];
    int threads = std::atoi(argv[2]);
    long iters = std::atol(argv[3]);
    omp_set_num_threads(threads);
#if defined(__AMX_TILE__)
    if (!std::strncmp(kind, "amx", 3) && syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 2;  // the tile state
#endif
    double sink = 0, best = 0;
    for (int round = 0; round < 3; round++) {
        auto start = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
        {
#if defined(__AVX512F__)
            __m512 a = _mm512_set1_ps(1e-9f), one = _mm512_set1_ps(1.0f);
            if (!std::strcmp(kind, "fp32"))
                LOOP(__m512, _mm512_setzero_ps(), a, _mm512_fmadd_ps(a, one, acc[i]));
#else
            __m256 a = _mm256_set1_ps(1e-9f), one = _mm256_set1_ps(1.0f);
            if (!std::strcmp(kind, "fp32"))
                LOOP(__m256, _mm256_setzero_ps(), a, _mm256_fmadd_ps(a, one, acc[i]));
#endif
#if defined(__AVX512BF16__)
            __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80);
            if (!std::strcmp(kind, "bf16"))
                LOOP(__m512, _mm512_setzero_ps(), b, _mm512_dpbf16_ps(acc[i], b, b));
#endif
#if defined(__AVX512VNNI__)
            __m512i u = _mm512_set1_epi8(1);
            if (!std::strcmp(kind, "int8"))
                LOOP(__m512i, _mm512_setzero_si512(), u, _mm512_dpbusd_epi32(acc[i], u, u));
#endif
#if defined(__AMX_TILE__)
            if (!std::strncmp(kind, "amx", 3)) {
                struct { unsigned char palette, start, reserved[14]; unsigned short colsb[16]; unsigned char rows[16]; }
                    config{};
                config.palette = 1;
                for (int t = 0; t < 8; t++) { config.colsb[t] = 64; config.rows[t] = 16; }
                _tile_loadconfig(&config);
                alignas(64) unsigned char operand[16 * 64];
                std::memset(operand, 1, sizeof operand);
                _tile_loadd(6, operand, 64);
                _tile_loadd(7, operand, 64);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
                const bool bf16 = !std::strcmp(kind, "amx_bf16");
                for (long t = 0; t < iters; t++) {
                    if (bf16) {
                        _tile_dpbf16ps(0, 6, 7); _tile_dpbf16ps(1, 6, 7); _tile_dpbf16ps(2, 6, 7);
                        _tile_dpbf16ps(3, 6, 7); _tile_dpbf16ps(4, 6, 7); _tile_dpbf16ps(5, 6, 7);
                    } else {
                        _tile_dpbusd(0, 6, 7); _tile_dpbusd(1, 6, 7); _tile_dpbusd(2, 6, 7);
                        _tile_dpbusd(3, 6, 7); _tile_dpbusd(4, 6, 7); _tile_dpbusd(5, 6, 7);
                    }
                }
                alignas(64) float out[16 * 16];
                _tile_stored(0, out, 64);
                sink += out[0];
                _tile_release();
            }
#endif
        }
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (round == 0 || seconds < best) best = seconds;
    }
    std::printf("%.6f %g\n", best, sink);
    return 0;
}
"""

KINDS = {
    # kind: (CPU flags needed, compiler flags, multiply-adds an iteration of its loop a thread; None: fp32's, 16
    # instructions of 16 lanes with AVX-512, else of 8; a tile product: 16 x 16 x 32 bf16, 16 x 16 x 64 int8)
    "fp32": (frozenset({"avx2", "fma"}), ["-mavx2", "-mfma"], None),
    "bf16": (frozenset({"avx512_bf16", "avx512bw"}), ["-mavx512f", "-mavx512bw", "-mavx512bf16"], 16 * 32),
    "int8": (frozenset({"avx512_vnni", "avx512bw"}), ["-mavx512f", "-mavx512bw", "-mavx512vnni"], 16 * 64),
    "amx_bf16": (frozenset({"amx_tile", "amx_bf16"}), ["-mavx2", "-mfma", "-mamx-tile", "-mamx-bf16"], 6 * 8192),
    "amx_int8": (frozenset({"amx_tile", "amx_int8"}), ["-mavx2", "-mfma", "-mamx-tile", "-mamx-int8"], 6 * 16384),
}
TILE_ITERATION_SHARE = 6
"""A tile loop's iteration (six tile products, each 16 cycles or more) takes as long as about six of a vector
loop's (16 instructions): the tile loops run ``iters`` / 6 iterations, so that a round lasts about as long."""


@functools.cache
def _work() -> Path:
    """The process's own temporary directory for the loops it builds, removed when the process exits."""
    directory = tempfile.TemporaryDirectory(prefix="densepass-cpu-peak-")
    atexit.register(directory.cleanup)
    return Path(directory.name)


@functools.cache
def _binary(kind: str, avx512: bool) -> Path | None:
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        return None
    work = _work() / kind
    work.mkdir()
    (work / "peak.cpp").write_text(SOURCE)
    flags = KINDS[kind][1] + (["-mavx512f"] if avx512 and kind == "fp32" else [])
    done = subprocess.run(
        [compiler, "-O2", "-fopenmp", *flags, str(work / "peak.cpp"), "-o", str(work / "peak")],
        capture_output=True,
        text=True,
    )
    return work / "peak" if done.returncode == 0 else None


def _cpu_words() -> frozenset[str]:
    from densepass.device import cpuinfo_words

    return cpuinfo_words()


def peak_gmacs(kind: str, threads: int | None = None, iters: int = 100_000_000) -> float | None:
    """Multiply-adds a second (G) of ``kind`` (``KINDS``) on ``threads`` (default torch's) threads, the fastest of
    three rounds; None where the CPU lacks the instructions or no compiler builds the loop. A round is ``iters`` x
    16 instructions a thread, about half a second at 3.6 GHz, so that a short disturbance (another thread still
    busy with the caller's last work) cannot spoil all three rounds: with rounds of a tenth of a second,
    ``bench_train.py`` twice measured half the bf16 peak, which it did not reproduce."""
    words = _cpu_words()
    if not KINDS[kind][0] <= words:
        return None
    avx512 = "avx512f" in words
    binary = _binary(kind, avx512)
    if binary is None:
        return None
    threads = threads or torch.get_num_threads()
    if threads < 1 or iters < 1:
        raise ValueError(f"threads and iterations must be >= 1, got {threads} and {iters}")
    if kind.startswith("amx"):
        iters = max(1, iters // TILE_ITERATION_SHARE)
    out = subprocess.run([str(binary), kind, str(threads), str(iters)], capture_output=True, text=True, check=True)
    seconds = float(out.stdout.split()[0])
    per_iteration = KINDS[kind][2] or 16 * (16 if avx512 else 8)
    return threads * iters * per_iteration / seconds / 1e9


def peak_tflops(bf16: bool, threads: int | None = None) -> tuple[float | None, str]:
    """The peak MFU divides by (TFLOPS, 2 FLOPs a multiply-add) for a model in bf16 (AMX tiles where the CPU has
    them, else ``vdpbf16ps``) or float32, and how it was had."""
    kind = "fp32"
    if bf16:
        kind = "amx_bf16" if KINDS["amx_bf16"][0] <= _cpu_words() else "bf16"
    gmacs = peak_gmacs(kind, threads)
    if gmacs is None:
        return None, f"no {kind} peak measured on this CPU"
    threads = threads or torch.get_num_threads()
    return 2 * gmacs / 1e3, f"measured: a loop of {kind} multiply-adds on {threads} threads (cpu_peak.py)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and torch's threads")
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    if args.threads and min(args.threads) < 1:
        parser.error("--threads must be >= 1")
    threads = args.threads or sorted({1, torch.get_num_threads()})
    rows, results = [], []
    for kind in KINDS:
        for n in threads:
            gmacs = peak_gmacs(kind, n)
            results.append({"kind": kind, "threads": n, "gmacs": gmacs})
            shown = ["-", "-"] if gmacs is None else [f"{gmacs:.1f}", f"{2 * gmacs / 1e3:.3f}"]
            rows.append([kind, n, *shown])
    facts = cpu_facts()
    print(f"{facts}")
    print(markdown_table(["kind", "threads", "G multiply-adds/s", "TFLOPS"], rows))
    write_json(args.out, {"cpu": facts, "results": results})


if __name__ == "__main__":
    main()
