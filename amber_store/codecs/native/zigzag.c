/* The lossless diff's host kernels (zigzag.h): plain loops the compiler vectorizes, in unsigned
 * arithmetic (which wraps, as the format's modulo says), one function per width. The baseline's
 * vectors (SSE2 on x86-64) suffice: a 4 MiB chunk's pass runs at memory speed (~9-11 GB/s here,
 * as numba's AVX-512 build did; an AVX2 clone measured the same). */
#include <stdint.h>
#include "zigzag.h"

#define KERNELS(U, BITS)                                                                           \
    static void zigzag_diff_##BITS(U *restrict out, const U *restrict value, const U *restrict base, \
                                   size_t n) {                                                     \
        for (size_t i = 0; i < n; i++) {                                                           \
            const U d = (U)(value[i] - base[i]);                                                   \
            out[i] = (U)((U)(d << 1) ^ (U)(0u - (d >> (BITS - 1))));                               \
        }                                                                                          \
    }                                                                                              \
    static void unzigzag_add_##BITS(U *restrict out, const U *restrict stored, size_t n) {         \
        for (size_t i = 0; i < n; i++) {                                                           \
            const U z = stored[i];                                                                 \
            out[i] = (U)(out[i] + (U)((z >> 1) ^ (U)(0u - (z & 1u))));                             \
        }                                                                                          \
    }

KERNELS(uint8_t, 8)
KERNELS(uint16_t, 16)
KERNELS(uint32_t, 32)
KERNELS(uint64_t, 64)

void zigzag_diff(void *out, const void *value, const void *base, size_t n, int width) {
    switch (width) {
    case 1: zigzag_diff_8(out, value, base, n); break;
    case 2: zigzag_diff_16(out, value, base, n); break;
    case 4: zigzag_diff_32(out, value, base, n); break;
    case 8: zigzag_diff_64(out, value, base, n); break;
    }
}

void unzigzag_add(void *out, const void *stored, size_t n, int width) {
    switch (width) {
    case 1: unzigzag_add_8(out, stored, n); break;
    case 2: unzigzag_add_16(out, stored, n); break;
    case 4: unzigzag_add_32(out, stored, n); break;
    case 8: unzigzag_add_64(out, stored, n); break;
    }
}
