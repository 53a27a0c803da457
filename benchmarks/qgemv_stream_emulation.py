"""qgemv_stream.cu's work split and arithmetic emulated in numpy, without a GPU (docs/results.md: the streamed GEMV).

    python benchmarks/qgemv_stream_emulation.py

Follows the kernel's index expressions: the block row ranges (N / grid +-1), ring slots of GR * RPG rows, row groups,
the 16-weight pieces t, t + 256, ... of each thread, the transposing warp butterfly (which lane ends with which
value), the per-(row, warp) sums and their final fixed-order add. Asserts that every (row, piece) is multiplied once,
every partial sum slot written once and every output once; prints the largest error against the float64 product of
the same dequantized weights, once with exact arithmetic (0 expected: the split loses nothing) and once with the
kernel's roundings (each HMUL2 / HFMA2 rounded to fp16, the pair sum and the scale's FMA to fp32).
"""

from __future__ import annotations

import numpy as np

from relaxtune.kernels import quant_formats as qf

THREADS = 256  # threads of a row group (kQ4PieceThreads)
WARPS = THREADS // 32


def transposed_sum(vals: np.ndarray) -> np.ndarray:
    """warp_transposed_sum for (32 lanes, NV values): per lane its final sum."""
    v, nv, lanes = vals.copy(), vals.shape[1], np.arange(32)
    n = nv
    while n > 1:
        offset = 16 * n // nv
        upper = (lanes & offset) != 0
        halved = np.empty((32, n // 2))
        for i in range(n // 2):
            give = np.where(upper, v[:, i], v[:, i + n // 2])
            keep = np.where(upper, v[:, i + n // 2], v[:, i])
            halved[:, i] = keep + give[lanes ^ offset]
        v, n = halved, n // 2
    s, offset = v[:, 0].copy(), 16 // nv
    while offset > 0:
        s, offset = s + s[lanes ^ offset], offset // 2
    return s


def piece_dot(x16: np.ndarray, w16: np.ndarray, scale: float, acc: float, rounded: bool) -> float:
    """acc + scale * sum(x16 * w16): the kernel's 8 HFMA2 (two fp16 chains of 8) and fp32 FMA, or exact."""
    if not rounded:
        return acc + float((x16 * w16).sum()) * scale
    d = np.float16(x16[0:2] * w16[0:2]).astype(np.float64)
    for e in range(1, 8):
        d = np.float16(x16[2 * e : 2 * e + 2] * w16[2 * e : 2 * e + 2] + d).astype(np.float64)
    pair = np.float32(np.float32(d[0]) + np.float32(d[1]))
    return float(np.float32(np.float64(pair) * scale + acc))


def emulate(x, packed, scale, groups: int, rows_per_group: int, max_pieces: int, sms: int, rounded: bool):
    """y (M, N) as qgemv_stream.cu's kernel s<groups>r<rows_per_group>p<max_pieces>_m<M> computes it."""
    m_rows, k = x.shape
    n, group_shift = packed.shape[0], int(np.log2(k // scale.shape[1] // 32))
    slot_rows, pieces = groups * rows_per_group, k // 16
    assert -(-pieces // THREADS) <= max_pieces and scale.shape[1] % 8 == 0
    q = qf.unpack_q4_gpu(packed).astype(np.float64) - 8
    xs, sc = x.astype(np.float64), scale.astype(np.float64)
    nv = rows_per_group * m_rows
    blocks = min(sms, n)
    y, seen, written = np.full((m_rows, n), np.nan), np.zeros((n, pieces), int), np.zeros(n, int)
    for b in range(blocks):
        row0 = b * n // blocks
        rows = (b + 1) * n // blocks - row0
        part = np.full((rows, m_rows, WARPS), np.nan)
        for s in range(-(-rows // slot_rows)):
            for g in range(groups):
                base = s * slot_rows + g * rows_per_group
                for warp in range(WARPS):
                    acc = np.zeros((32, nv))
                    for i in range(rows_per_group):
                        if base + i >= rows:
                            break
                        r = row0 + base + i
                        for lane in range(32):
                            for j in range(max_pieces):
                                piece = warp * 32 + lane + THREADS * j
                                if piece >= pieces:
                                    break
                                seen[r, piece] += 1
                                w16, scl = q[r, 16 * piece : 16 * piece + 16], sc[r, piece >> (1 + group_shift)]
                                for m in range(m_rows):
                                    x16 = xs[m, 16 * piece : 16 * piece + 16]
                                    acc[lane, i * m_rows + m] = piece_dot(
                                        x16, w16, scl, acc[lane, i * m_rows + m], rounded
                                    )
                    sums = transposed_sum(acc)
                    for lane in range(0, 32, 32 // nv):
                        which = lane // (32 // nv)
                        row = base + which // m_rows
                        if row < rows:
                            assert np.isnan(part[row, which % m_rows, warp])
                            part[row, which % m_rows, warp] = sums[lane]
        assert not np.isnan(part).any()
        for out in range(rows * m_rows):
            row, m = out // m_rows, out % m_rows
            y[m, row0 + row] = part[row, m].sum()
            written[row0 + row] += 1
    assert (seen == 1).all() and (written == m_rows).all()
    return y


def main() -> None:
    rng = np.random.default_rng(1)
    lanes = np.arange(32)
    for nv in (1, 2, 4, 8, 16, 32):  # lane l ends with the sum of value l / (32 / nv)
        vals = rng.standard_normal((32, nv))
        assert np.allclose(transposed_sum(vals), vals.sum(0)[lanes // (32 // nv)]), nv
    # (K, N, group, rows of x, (GR, RPG, PMAX)), 7 SMs: ragged row ranges, slots and pieces
    cases = [
        (256, 37, 32, 2, (2, 4, 1)),
        (1024, 300, 128, 1, (3, 2, 1)),
        (1024, 300, 128, 2, (1, 8, 1)),
        (4096, 40, 32, 2, (2, 8, 1)),
        (11008, 13, 32, 2, (2, 4, 3)),
        (11008, 9, 32, 1, (1, 8, 3)),
        (4096, 40, 32, 1, (2, 2, 3)),
    ]
    for k, n, group, m_rows, kind in cases:
        w = rng.standard_normal((n, k)).astype(np.float32) / np.float32(k**0.5)
        parts = qf.quantize(qf.own_format(4, group), w)
        packed = qf.pack_q4_gpu(parts["qweight"])
        ref = rng.standard_normal((m_rows, k)).astype(np.float16)
        want = ref.astype(np.float64) @ qf.dequantize_q4_gpu(packed, parts["scale"]).astype(np.float64).T
        exact = emulate(ref, packed, parts["scale"], *kind, sms=7, rounded=False)
        rounded = emulate(ref, packed, parts["scale"], *kind, sms=7, rounded=True)
        print(
            f"K={k} N={n} group={group} rows={m_rows} s{kind[0]}r{kind[1]}p{kind[2]}: "
            f"exact {np.abs(exact - want).max():.2e}, with the kernel's roundings {np.abs(rounded - want).max():.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
