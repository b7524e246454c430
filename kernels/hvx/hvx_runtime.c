/* The runtime behind hvx_runtime.h: the only assembly in kernels/hvx/ is here (a syscall is trap0 with
 * the number in r6; QEMU's counters are control registers the assembler has no names for). */
#include "hvx_runtime.h"

long hvx_syscall(long nr, long a, long b, long c, long d, long e, long f) {
    register long r0 __asm__("r0") = a;
    register long r1 __asm__("r1") = b;
    register long r2 __asm__("r2") = c;
    register long r3 __asm__("r3") = d;
    register long r4 __asm__("r4") = e;
    register long r5 __asm__("r5") = f;
    register long r6 __asm__("r6") = nr;
    __asm__ volatile("trap0(#1)" : "+r"(r0) : "r"(r1), "r"(r2), "r"(r3), "r"(r4), "r"(r5), "r"(r6) : "memory");
    return r0;
}

void hvx_exit(int code) {
    for (;;) hvx_syscall(SYS_EXIT, code, 0, 0, 0, 0, 0);
}

int hvx_read_all(int fd, void *buf, uint32_t n) {
    uint8_t *p = buf;
    while (n) {
        long got = hvx_syscall(SYS_READ, fd, (long)p, n, 0, 0, 0);
        if (got <= 0) return -1;
        p += got;
        n -= (uint32_t)got;
    }
    return 0;
}

int hvx_write_all(int fd, const void *buf, uint32_t n) {
    const uint8_t *p = buf;
    while (n) {
        long put = hvx_syscall(SYS_WRITE, fd, (long)p, n, 0, 0, 0);
        if (put <= 0) return -1;
        p += put;
        n -= (uint32_t)put;
    }
    return 0;
}

uint32_t hvx_scalar_packets;

#ifdef HVX_NO_QEMU_COUNTERS
void hvx_counts_now(struct hvx_counts *c) { c->packets = c->insns = c->hvx_insns = 0; }
uint32_t hvx_packets_now(void) { return 0; }
#else
/* "r0 = c20" etc. as raw words (A2_tfrcrr: 0x6a00c000 | creg << 16 | rd) */
#define READ_CREG(word) ({ register uint32_t r __asm__("r0"); __asm__ volatile(".word " #word : "=r"(r)); r; })
void hvx_counts_now(struct hvx_counts *c) {
    c->packets = READ_CREG(0x6a14c000);
    c->insns = READ_CREG(0x6a15c000);
    c->hvx_insns = READ_CREG(0x6a16c000);
}
uint32_t hvx_packets_now(void) { return READ_CREG(0x6a14c000); }
#endif

/* clang may emit calls to these even in freestanding code (struct copies, zeroing loops); no_builtin keeps
   it from turning their own loops back into calls to themselves */
__attribute__((no_builtin("memcpy"))) void *memcpy(void *dst, const void *src, size_t n) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

__attribute__((no_builtin("memset"))) void *memset(void *dst, int v, size_t n) {
    uint8_t *d = dst;
    while (n--) *d++ = (uint8_t)v;
    return dst;
}
