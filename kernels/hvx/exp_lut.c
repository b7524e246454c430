/* exp of non-positive float16 inputs by a 32768-entry float16 table (NPU TTS paper §5.2; kernels/lut.py):
 * safe softmax feeds x - max(x) <= 0, so the sign bit is dropped and the other 15 bits index the table.
 * vgather reads 64 halfwords per instruction from a 64 KiB region (VTCM on a phone; any memory under QEMU).
 */
#include <hexagon_types.h>
#include <hvx_hexagon_protos.h>

#include "hvx_kernels.h"

static HVX_Vector gathered; /* vgather's destination (VTCM on a DSP) */

void hvx_exp_lut(const uint16_t *x, const uint16_t *table, uint16_t *out, uint32_t n) {
    HVX_Vector magnitude = Q6_Vh_vsplat_R(0x7FFF);
    const HVX_Vector *xv = (const HVX_Vector *)x;
    HVX_Vector *ov = (HVX_Vector *)out;
    for (uint32_t i = 0; i < n / 64; i++) {
        HVX_Vector offsets = Q6_Vh_vasl_VhR(Q6_V_vand_VV(xv[i], magnitude), 1); /* byte offsets of entries */
        Q6_vgather_ARMVh(&gathered, (int)(uintptr_t)table, 32768 * 2 - 1, offsets);
        ov[i] = gathered;
    }
}
