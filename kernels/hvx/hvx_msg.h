/* The one message format between the agent (host) and the Hexagon program, both directions.
 *
 * A request and its reply are the same 80-byte struct, little-endian, sent over the program's stdin /
 * stdout (FastRPC's role). Tensors never travel in messages: they lie in one shared arena (a memfd the
 * host maps too, like FastRPC's ION / dmabuf buffers) and a message names them by byte offset.
 * Python mirror: edgeprobe_kernels/hvx_bridge.py (MSG_FORMAT, OP_*, STATUS_*): change both together.
 */
#ifndef EDGEPROBE_HVX_MSG_H
#define EDGEPROBE_HVX_MSG_H

#include <stdint.h>

#define HVX_MSG_MAGIC 0x31585648u /* "HVX1" little-endian */
#define HVX_MSG_VERSION 1u

enum hvx_op {
    HVX_OP_INIT = 1,            /* buf[0] = arena fd, k = arena bytes: map the shared arena */
    HVX_OP_PING = 2,            /* reply m = sizeof(struct hvx_msg), k = vector bytes, n = HVX_MSG_VERSION */
    HVX_OP_QUANTIZE = 3,        /* buf0 x f32[m,k] (flags&1: buf3 smooth f32[k], buf4 x/smooth), scale0 -> buf2 i8[m,kp] */
    HVX_OP_GEMM_S8S32 = 4,      /* buf0 a i8[m,k], buf1 b packed [k/4][n][4] -> buf2 c i32[m,n]; k%4 == 0, n%32 == 0 */
    HVX_OP_W8A8 = 5,            /* buf0 x f32[m,k], buf1 b packed, buf3 smooth, buf4 scratch -> buf2 y f32[m,n] */
    HVX_OP_Q4_TILE_DEQUANT = 6, /* buf0 super-blocks u8[m,144] -> buf2 f16[m*256] (vlut16) */
    HVX_OP_EXP_LUT = 7,         /* buf0 f16[n] (n%64 == 0), buf1 table f16[32768] -> buf2 f16[n] (vgather) */
    HVX_OP_EXIT = 8,
    HVX_OP_GEMM_F16W = 9,       /* buf0 x f32[m,k], buf1 w f32[n,k] (float16 values), buf4 scratch f32[m,k] -> buf2 y f32[m,n] */
};

enum hvx_status {
    HVX_OK = 0,
    HVX_E_MAGIC = 1,    /* not a message of this format / version */
    HVX_E_OP = 2,       /* unknown op */
    HVX_E_RANGE = 3,    /* a buffer lies outside the arena */
    HVX_E_SHAPE = 4,    /* shape not allowed for the op */
    HVX_E_ALIGN = 5,    /* a vector buffer is not 128-byte aligned */
    HVX_E_STATE = 6,    /* no arena mapped yet (INIT first) */
    HVX_E_MMAP = 7,     /* INIT could not map the arena */
};

struct hvx_msg {
    uint32_t magic, op, seq, status;
    uint32_t m, k, n, flags;   /* shapes, per op (see enum hvx_op) */
    uint32_t buf[6];           /* byte offsets into the arena */
    uint32_t scale[2];         /* float32 bit patterns: scale0 = activation scale, scale1 = output scale */
    /* reply, QEMU's own counters over the op: packets, instructions, HVX instructions, and the packets of
       its scalar float phases (quantize / requantize / table build), so vector and scalar work read apart */
    uint32_t count[4];
};

#define HVX_FLAG_SMOOTH 1u

_Static_assert(sizeof(struct hvx_msg) == 80, "the Python mirror packs 20 little-endian uint32");

#endif
