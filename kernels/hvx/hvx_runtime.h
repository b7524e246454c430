/* A freestanding runtime for a Linux-user Hexagon program (qemu-hexagon here; a phone's cDSP loads
 * the same kernels through FastRPC instead, docs/hvx.md): syscalls, QEMU's execution counters, memory.
 */
#ifndef EDGEPROBE_HVX_RUNTIME_H
#define EDGEPROBE_HVX_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

/* Linux asm-generic syscall numbers (Hexagon Linux uses the generic table) */
#define SYS_READ 63
#define SYS_WRITE 64
#define SYS_EXIT 93
#define SYS_MMAP2 222

long hvx_syscall(long nr, long a, long b, long c, long d, long e, long f);
void hvx_exit(int code) __attribute__((noreturn));
/* read / write exactly n bytes; 0 on success, -1 on end of file or error */
int hvx_read_all(int fd, void *buf, uint32_t n);
int hvx_write_all(int fd, const void *buf, uint32_t n);

/* QEMU counts executed packets, instructions and HVX instructions in private control registers
 * (c20, c21, c22 of QEMU 7.2's Hexagon target); on real silicon they do not exist, so a DSP build
 * (-DHVX_NO_QEMU_COUNTERS) reads zeros and would use the PCYCLE registers instead. */
struct hvx_counts { uint32_t packets, insns, hvx_insns; };
void hvx_counts_now(struct hvx_counts *c);
uint32_t hvx_packets_now(void);
/* packets spent in scalar float phases during the current request (kernels add theirs; main.c reports it), so
   a reply tells vector and scalar work apart */
extern uint32_t hvx_scalar_packets;

void *memcpy(void *dst, const void *src, size_t n);
void *memset(void *dst, int v, size_t n);

#endif
