/* The Hexagon program's entry and request loop: read a struct hvx_msg from stdin, check every buffer it names
 * against the shared arena, run the kernel, answer with the same struct (status and counters) on stdout.
 * A bad message gets an error status and the loop goes on; end of input ends the program.
 */
#include "hvx_kernels.h"
#include "hvx_msg.h"
#include "hvx_runtime.h"

#define PROT_RW 3
#define MAP_SHARED 1

static uint8_t *arena;
static uint32_t arena_bytes;

/* the arena bytes [off, off + len), or 0 when they leave the arena or break the alignment a vector load needs */
static void *span(uint32_t off, uint64_t len, uint32_t align, uint32_t *status) {
    if (*status != HVX_OK) return 0;
    if ((uint64_t)off + len > arena_bytes) {
        *status = HVX_E_RANGE;
        return 0;
    }
    if (off & (align - 1)) {
        *status = HVX_E_ALIGN;
        return 0;
    }
    return arena + off;
}

static uint32_t do_init(struct hvx_msg *msg) {
    long p = hvx_syscall(SYS_MMAP2, 0, msg->k, PROT_RW, MAP_SHARED, (long)msg->buf[0], 0);
    if (p < 0 && p > -4096) return HVX_E_MMAP;
    arena = (uint8_t *)p;
    arena_bytes = msg->k;
    return HVX_OK;
}

static uint32_t run(struct hvx_msg *msg) {
    uint32_t st = HVX_OK, M = msg->m, K = msg->k, N = msg->n;
    uint64_t m = M, k = K, n = N, kp = (k + 3) & ~3ull, np = (n + 31) & ~31ull;
    switch (msg->op) {
    case HVX_OP_PING:
        msg->m = sizeof(struct hvx_msg);
        msg->k = HVX_BYTES;
        msg->n = HVX_MSG_VERSION;
        return HVX_OK;
    case HVX_OP_INIT:
        return do_init(msg);
    case HVX_OP_EXIT:
        hvx_exit(0);
    }
    if (!arena) return HVX_E_STATE;
    switch (msg->op) {
    case HVX_OP_QUANTIZE: {
        if (!M || !K || K > HVX_MAX_K) return HVX_E_SHAPE;
        int smooth = msg->flags & HVX_FLAG_SMOOTH;
        const uint32_t *x = span(msg->buf[0], m * k * 4 + HVX_OVERREAD, 4, &st);
        int8_t *q = span(msg->buf[2], m * kp, 1, &st);
        const uint32_t *sm = smooth ? span(msg->buf[3], k * 4, 4, &st) : 0;
        uint32_t *xs = smooth ? span(msg->buf[4], m * k * 4 + HVX_OVERREAD, 4, &st) : 0;
        if (st) return st;
        hvx_quantize(x, sm, xs, msg->scale[0], q, M, K, (uint32_t)kp);
        return HVX_OK;
    }
    case HVX_OP_GEMM_S8S32: {
        if (!M || !K || !N || K % 4 || N % 32) return HVX_E_SHAPE;
        const int8_t *a = span(msg->buf[0], m * k, 4, &st);
        const uint8_t *b = span(msg->buf[1], k * n, HVX_BYTES, &st);
        int32_t *c = span(msg->buf[2], m * n * 4, HVX_BYTES, &st);
        if (st) return st;
        hvx_gemm_s8s32(a, b, c, M, K, N);
        return HVX_OK;
    }
    case HVX_OP_W8A8: {
        if (!M || !K || !N || K > HVX_MAX_K) return HVX_E_SHAPE;
        int smooth = msg->flags & HVX_FLAG_SMOOTH;
        /* scratch: q int8[M][Kp] | ctile int32[4][Np] | xs float32[M][K] (smoothing only) */
        uint64_t qbytes = (m * kp + HVX_BYTES - 1) & ~(uint64_t)(HVX_BYTES - 1);
        uint64_t scratch_bytes = qbytes + 4 * np * 4 + (smooth ? m * k * 4 + HVX_OVERREAD : 0);
        const uint32_t *x = span(msg->buf[0], m * k * 4 + HVX_OVERREAD, 4, &st);
        const uint8_t *b = span(msg->buf[1], kp * np, HVX_BYTES, &st);
        uint32_t *y = span(msg->buf[2], m * n * 4, 4, &st);
        const uint32_t *sm = smooth ? span(msg->buf[3], k * 4, 4, &st) : 0;
        uint8_t *scratch = span(msg->buf[4], scratch_bytes, HVX_BYTES, &st);
        if (st) return st;
        hvx_w8a8(x, sm, b, y, (int8_t *)scratch, (int32_t *)(scratch + qbytes),
                 smooth ? (uint32_t *)(scratch + qbytes + 4 * np * 4) : 0, M, K, N, msg->scale[0], msg->scale[1]);
        return HVX_OK;
    }
    case HVX_OP_Q4_TILE_DEQUANT: {
        if (!M) return HVX_E_SHAPE;
        const uint8_t *blocks = span(msg->buf[0], m * 144, 1, &st);
        uint16_t *out = span(msg->buf[2], m * 512, HVX_BYTES, &st);
        if (st) return st;
        hvx_q4_tile_dequant(blocks, out, M);
        return HVX_OK;
    }
    case HVX_OP_GEMM_F16W: {
        if (!M || !K || !N) return HVX_E_SHAPE;
        const uint32_t *x = span(msg->buf[0], m * k * 4, 4, &st);
        const float *w = span(msg->buf[1], n * k * 4, 4, &st);
        float *y = span(msg->buf[2], m * n * 4, 4, &st);
        float *xh = span(msg->buf[4], m * k * 4, 4, &st);
        if (st) return st;
        hvx_gemm_f16w(x, w, y, xh, M, K, N);
        return HVX_OK;
    }
    case HVX_OP_EXP_LUT: {
        if (!N || N % 64) return HVX_E_SHAPE;
        const uint16_t *x = span(msg->buf[0], n * 2, HVX_BYTES, &st);
        const uint16_t *table = span(msg->buf[1], 32768 * 2, HVX_BYTES, &st);
        uint16_t *out = span(msg->buf[2], n * 2, HVX_BYTES, &st);
        if (st) return st;
        hvx_exp_lut(x, table, out, N);
        return HVX_OK;
    }
    }
    return HVX_E_OP;
}

void _start(void) {
    struct hvx_msg msg;
    for (;;) {
        if (hvx_read_all(0, &msg, sizeof msg)) hvx_exit(0); /* the host closed the pipe: done */
        struct hvx_counts t0, t1;
        hvx_scalar_packets = 0;
        hvx_counts_now(&t0);
        msg.status = msg.magic != HVX_MSG_MAGIC ? HVX_E_MAGIC : run(&msg);
        hvx_counts_now(&t1);
        msg.count[0] = t1.packets - t0.packets;
        msg.count[1] = t1.insns - t0.insns;
        msg.count[2] = t1.hvx_insns - t0.hvx_insns;
        msg.count[3] = hvx_scalar_packets;
        if (hvx_write_all(1, &msg, sizeof msg)) hvx_exit(1);
    }
}
