"""The npu lane's kernels as Hexagon HVX code under qemu-hexagon, against the numba backend, same shapes, one run.

Per kernel and call (SmolLM2-135M shapes, a 16-token prefill unless noted): QEMU's wall time and the numba
backend's (best of N), the packets / HVX instructions QEMU counted, and the estimate of a v73 cDSP's time
(hvx_bridge.dsp_estimate: 1 packet per cycle on one thread, clock assumed). The GEMM's hot loop is also read
from the disassembly (llvm-objdump-15): packets per iteration x trip count, against QEMU's count.

    .venv/bin/python bench/hvx.py [--repeat 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess

import numpy as np
from timing import best_of

LINEARS = {"attn_q/o": (576, 576), "attn_k/v": (576, 192), "ffn_gate/up": (576, 1536), "ffn_down": (1536, 576)}


def hot_loop(elf, function: str = "hvx_gemm_s8s32", mnemonic: str = "vrmpy") -> dict | None:
    """The densest loop of `function` in `mnemonic` (instructions per packet): its packets per iteration and
    those instructions. A loop closes with a backward jump or :endloop0/1 (hardware loop, target from loopN)."""
    objdump = shutil.which("llvm-objdump-15")
    if objdump is None:
        return None
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", "--mcpu=hexagonv67", "--mattr=+hvxv67,+hvx-length128b",
                           f"--disassemble-symbols={function}", str(elf)], capture_output=True, text=True).stdout
    packets, cur, hw = [], None, {}  # packet: [address, [instructions], backward target or None]
    for line in text.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(\{?)\s*(.*)", line)
        if not m:
            continue
        addr, opens, body = int(m.group(1), 16), m.group(2), m.group(3)
        if opens or cur is None:
            cur = [addr, [], None]
            packets.append(cur)
        cur[1].append(body)
        for n, target in re.findall(r"loop([01])\(0x([0-9a-f]+)", body):
            hw[n] = int(target, 16)
        j = re.search(r"jump:?\w* 0x([0-9a-f]+)", body)
        if j and int(j.group(1), 16) <= cur[0]:
            cur[2] = int(j.group(1), 16)
        e = re.search(r":endloop([01])", body)
        if e and e.group(1) in hw:
            cur[2] = hw[e.group(1)]
    best = None
    for i, (addr, ins, back) in enumerate(packets):
        if back is None:
            continue
        body = [p for p in packets[:i + 1] if p[0] >= back]
        n = sum(" ".join(p[1]).count(mnemonic) for p in body)
        if n and (best is None or n / len(body) > best["count"] / best["packets"]):
            best = {"packets": len(body), "count": n, "start": hex(back)}
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    from edgeprobe_kernels import hvx_bridge
    from edgeprobe_kernels.int8_gemm import gemm_s8s32_numba
    from edgeprobe_kernels.linear_records import run_w8a8, x_wt
    from edgeprobe_kernels.lut import exp_lut, exp_table, lut16_dequant
    from edgeprobe_kernels.tiles import quantize_tiles, unpack_superblocks

    dsp = hvx_bridge.HvxDsp().start()
    rng = np.random.default_rng(0)
    M, rows = args.tokens, []

    def row(kernel, shape, ops, fn_hvx, fn_numba):
        c = {}
        fn_hvx(c)  # packs the weight, builds a new scale's thresholds: not part of a steady-state call
        c = {}
        fn_hvx(c)
        th = best_of(lambda: fn_hvx(None), args.repeat)
        tn = best_of(fn_numba, args.repeat, warmup=True)
        est = hvx_bridge.dsp_estimate(c)
        r = {"kernel": kernel, "shape": shape, "qemu_ms": th * 1e3, "numba_ms": tn * 1e3, "slowdown": th / tn, **est}
        if ops:
            r.update(qemu_gops=ops / th / 1e9, numba_gops=ops / tn / 1e9,
                     dsp_gops_estimate=ops / (est["dsp_us_estimate"] * 1e3))
        rows.append(r)
        print(f"{kernel:14s} {shape:>18s} qemu {th * 1e3:8.2f} ms  numba {tn * 1e3:7.2f} ms  x{th / tn:6.1f}  "
              f"packets {c['packets']:>9,d} (scalar {c['scalar_packets']:>7,d})  "
              f"dsp est {est['dsp_us_estimate']:8.1f} us"
              + (f"  GOP/s qemu {r['qemu_gops']:.2f} numba {r['numba_gops']:.1f} "
                 f"dsp-est {r['dsp_gops_estimate']:.1f}" if ops else ""))

    for name, (K, N) in LINEARS.items():
        x = (rng.standard_normal((M, K)) * 2).astype(np.float32)
        wt = rng.integers(-127, 128, (K, N), dtype=np.int8)
        sa, sw = float(np.abs(x).max() / 127), 0.01
        f = run_w8a8({"wt": "w", "scale_a": sa, "scale_w": sw}, lambda k: wt, {}, keep_f32=True)
        row("w8a8", f"{M}x{K}x{N} {name}", 2 * M * K * N,
            lambda c: dsp.w8a8(x, wt, sa, sw, key=("bench", K, N), counters=c), lambda: f(x))
    for name, (K, N) in list(LINEARS.items())[2:3]:
        a = rng.integers(-127, 128, (M, K), dtype=np.int8)
        wt = rng.integers(-127, 128, (K, N), dtype=np.int8)
        row("gemm_s8s32", f"{M}x{K}x{N}", 2 * M * K * N,
            lambda c: dsp.gemm_s8s32(a, wt, key=("bench-g", K, N), counters=c), lambda: gemm_s8s32_numba(a, wt))
        x = rng.standard_normal((M, K)).astype(np.float32)
        w16 = rng.standard_normal((N, K)).astype(np.float16)
        wf = w16.astype(np.float32)
        row("gemm_f16w", f"{M}x{K}x{N}", 2 * M * K * N,
            lambda c: dsp.gemm_f16w(x, w16, key=("bench-f", K, N), counters=c),
            lambda: x_wt(x.astype(np.float16).astype(np.float32), wf))
        blocks = quantize_tiles(rng.standard_normal((N, K)).astype(np.float32))
        q, d = unpack_superblocks(blocks)
        row("q4_tile_dequant", f"{N}x{K} weight", 0, lambda c: dsp.q4_tile_dequant(blocks, counters=c),
            lambda: lut16_dequant(q, d))
    table = exp_table()
    s = -np.abs(rng.standard_normal(9 * M * M * 8)).astype(np.float16)
    row("exp_lut", f"{len(s)} values", 0, lambda c: dsp.exp_lut(s, table, counters=c), lambda: exp_lut(s))

    loop = hot_loop(dsp.elf)
    if loop:
        K, N = LINEARS["ffn_gate/up"]
        trips = -(-M // 4) * (N // 128) * (K // 4)  # row blocks x 4-vector column blocks x groups of 4 inputs
        g = next(r for r in rows if r["kernel"] == "gemm_s8s32")
        print(f"gemm hot loop (disassembly, from {loop['start']}): {loop['packets']} packets, "
              f"{loop['count']} vrmpy per iteration; x {trips} iterations = {loop['packets'] * trips:,d} packets, "
              f"QEMU counted {g['hvx_packets']:,d}")
        rows.append({"kernel": "gemm_s8s32 hot loop", "packets_per_iteration": loop["packets"],
                     "vrmpy_per_iteration": loop["count"], "iterations": trips,
                     "static_packets": loop["packets"] * trips, "qemu_packets": g["hvx_packets"]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    dsp.close()


if __name__ == "__main__":
    main()
