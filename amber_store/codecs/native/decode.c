/* The native decoder (amber_store.codecs._blosc1): decodes the stored chunks a load reads the
 * most (c-blosc 1.x frames of 2- or 4-byte elements, bit-shuffled, lz4) in one pass per block: lz4 into a block buffer,
 * then a bit-unshuffle that stores the values or applies them, as a lossless diff, onto the base
 * bits already in the output. c-blosc unshuffles in two passes, copies incompressible streams
 * first, and leaves the apply to a third pass (measured on a delta step's load: see
 * docs/PERFORMANCE.md).
 *
 * One unshuffle algorithm (unshuffle.h) compiled for each target it runs on: AVX2 on x86-64 and
 * the compiler's baseline (SSE2 there, NEON on aarch64: "portable"), chosen at run time; on
 * x86-64 CPUs with AVX-512 VBMI and GFNI, a kernel of their own transposes bits with one affine
 * op. Every path takes 2- and 4-byte elements. Frames are validated here whatever the caller checked: a
 * corrupt one raises ValueError and never reads or writes out of bounds (lz4's safe decoder,
 * offsets bounded). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "decode.h"
#include "lz4.h"

/* unshuffle.h's shuffles need __builtin_shufflevector (GCC 12+, Clang): an older compiler
 * builds the AVX-512 kernel alone, and c-blosc decodes the rest */
#ifndef VECTOR_KERNELS
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define VECTOR_KERNELS 1
#else
#define VECTOR_KERNELS 0
#endif
#endif

const char *const PATH_NAMES[NPATHS] = {"avx512", "avx2", "portable"};
int runs[NPATHS] = {0, 0, VECTOR_KERNELS};

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define X86 1
#else
#define X86 0
#endif

static uint32_t u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Every field the decode divides or sizes by is checked here (a block of 0 included). */
int read_header(const uint8_t *f, size_t len, size_t nbytes, int typesize, header_t *h) {
    if (len < HEADER) return 0;
    h->flags = f[2];
    h->typesize = f[3];
    h->size = u32(f + 4);
    h->block = u32(f + 8);
    return (h->typesize == 2 || h->typesize == 4) && (typesize == 0 || typesize == h->typesize) &&
           (h->flags & DOBITSHUFFLE) && !(h->flags & (DOSHUFFLE | MEMCPYED)) && (h->flags >> 5) == LZ4_FORMAT &&
           h->size == nbytes && h->block > 0 && h->block % 2048 == 0 && h->size % h->block == 0;
}

#if X86
/* Bit-unshuffle one block of `n` elements of ts (2 or 4) bytes (n % 512 == 0) whose bit planes
 * of byte j lie at planes[j] (8 rows of n / 8 bytes), storing the elements into dst or adding
 * their zigzag decoding to it. Per 512 elements: eight 64-byte rows of each byte's planes,
 * transposed as 8x8 qwords, then as 8x8 bytes (vpermb) and 8x8 bits (one affine op per qword),
 * and the bytes of each element interleaved. */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi,gfni")))
AVX512_TARGET static inline __attribute__((always_inline)) void unshuffle_avx512_of(
        const uint8_t *const planes[4], uint8_t *dst, size_t n, const int ts, const int op) {
    const size_t rowlen = n / 8;
    uint8_t tb[64], ilo[64], ihi[64];
    uint16_t wlo[32], whi[32];
    for (int c = 0; c < 8; c++)
        for (int m = 0; m < 8; m++) tb[c * 8 + m] = (uint8_t)((7 - m) * 8 + c);
    for (int e = 0; e < 32; e++) {
        ilo[2 * e] = (uint8_t)e; ilo[2 * e + 1] = (uint8_t)(64 + e);
        ihi[2 * e] = (uint8_t)(32 + e); ihi[2 * e + 1] = (uint8_t)(96 + e);
    }
    for (int e = 0; e < 16; e++) {
        wlo[2 * e] = (uint16_t)e; wlo[2 * e + 1] = (uint16_t)(32 + e);
        whi[2 * e] = (uint16_t)(16 + e); whi[2 * e + 1] = (uint16_t)(48 + e);
    }
    const __m512i T = _mm512_loadu_si512(tb), IL = _mm512_loadu_si512(ilo), IH = _mm512_loadu_si512(ihi);
    const __m512i WL = _mm512_loadu_si512(wlo), WH = _mm512_loadu_si512(whi);
    const __m512i BITT = _mm512_set1_epi64(0x8040201008040201ULL); /* transposes each 8x8 bit block */
    for (size_t g = 0; g < rowlen; g += 64) {
        __m512i P[4][8];
        for (int j = 0; j < ts; j++) {
            const uint8_t *r = planes[j] + g;
            __m512i R[8], t[8], u[8], x[8];
            for (int k = 0; k < 8; k++) R[k] = _mm512_loadu_si512(r + k * rowlen);
            for (int k = 0; k < 8; k += 2) {
                t[k] = _mm512_unpacklo_epi64(R[k], R[k + 1]);
                t[k + 1] = _mm512_unpackhi_epi64(R[k], R[k + 1]);
            }
            u[0] = _mm512_shuffle_i64x2(t[0], t[2], 0x88); u[1] = _mm512_shuffle_i64x2(t[0], t[2], 0xDD);
            u[2] = _mm512_shuffle_i64x2(t[1], t[3], 0x88); u[3] = _mm512_shuffle_i64x2(t[1], t[3], 0xDD);
            u[4] = _mm512_shuffle_i64x2(t[4], t[6], 0x88); u[5] = _mm512_shuffle_i64x2(t[4], t[6], 0xDD);
            u[6] = _mm512_shuffle_i64x2(t[5], t[7], 0x88); u[7] = _mm512_shuffle_i64x2(t[5], t[7], 0xDD);
            x[0] = _mm512_shuffle_i64x2(u[0], u[4], 0x88); x[4] = _mm512_shuffle_i64x2(u[0], u[4], 0xDD);
            x[2] = _mm512_shuffle_i64x2(u[1], u[5], 0x88); x[6] = _mm512_shuffle_i64x2(u[1], u[5], 0xDD);
            x[1] = _mm512_shuffle_i64x2(u[2], u[6], 0x88); x[5] = _mm512_shuffle_i64x2(u[2], u[6], 0xDD);
            x[3] = _mm512_shuffle_i64x2(u[3], u[7], 0x88); x[7] = _mm512_shuffle_i64x2(u[3], u[7], 0xDD);
            for (int i = 0; i < 8; i++)
                P[j][i] = _mm512_gf2p8affine_epi64_epi8(BITT, _mm512_permutexvar_epi8(T, x[i]), 0);
        }
        /* P[j][i]: byte j of the 64 elements from (g + 8i) * 8 */
        for (int i = 0; i < 8; i++) {
            __m512i o[4];
            const __m512i al = _mm512_permutex2var_epi8(P[0][i], IL, P[1][i]), ah = _mm512_permutex2var_epi8(P[0][i], IH, P[1][i]);
            if (ts == 2) {
                o[0] = al; o[1] = ah;
            } else {
                const __m512i bl = _mm512_permutex2var_epi8(P[2][i], IL, P[3][i]), bh = _mm512_permutex2var_epi8(P[2][i], IH, P[3][i]);
                o[0] = _mm512_permutex2var_epi16(al, WL, bl); o[1] = _mm512_permutex2var_epi16(al, WH, bl);
                o[2] = _mm512_permutex2var_epi16(ah, WL, bh); o[3] = _mm512_permutex2var_epi16(ah, WH, bh);
            }
            uint8_t *d = dst + (g + 8 * i) * 8 * ts;
            for (int q = 0; q < ts; q++) {
                if (op == OP_STORE) {
                    _mm512_storeu_si512(d + 64 * q, o[q]);
                } else if (ts == 4) { /* the diff's zigzag: 0, -1, 1, -2, ... <- 0, 1, 2, 3, ... */
                    const __m512i z = o[q];
                    const __m512i v = _mm512_xor_si512(_mm512_srli_epi32(z, 1), _mm512_sub_epi32(
                        _mm512_setzero_si512(), _mm512_and_si512(z, _mm512_set1_epi32(1))));
                    _mm512_storeu_si512(d + 64 * q, _mm512_add_epi32(_mm512_loadu_si512(d + 64 * q), v));
                } else {
                    const __m512i z = o[q];
                    const __m512i v = _mm512_xor_si512(_mm512_srli_epi16(z, 1), _mm512_sub_epi16(
                        _mm512_setzero_si512(), _mm512_and_si512(z, _mm512_set1_epi16(1))));
                    _mm512_storeu_si512(d + 64 * q, _mm512_add_epi16(_mm512_loadu_si512(d + 64 * q), v));
                }
            }
        }
    }
}

/* (each width and op compiled apart, as in unshuffle.h) */
AVX512_TARGET static void unshuffle_avx512(const uint8_t *const planes[4], uint8_t *dst, size_t n, int ts, int op) {
    if (ts == 4)
        op == OP_STORE ? unshuffle_avx512_of(planes, dst, n, 4, OP_STORE) : unshuffle_avx512_of(planes, dst, n, 4, OP_UNZIGZAG_ADD);
    else
        op == OP_STORE ? unshuffle_avx512_of(planes, dst, n, 2, OP_STORE) : unshuffle_avx512_of(planes, dst, n, 2, OP_UNZIGZAG_ADD);
}

#if VECTOR_KERNELS
#define KERNEL unshuffle_avx2
#define WIDE_VECTORS 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#include "unshuffle.h"
#pragma clang attribute pop
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#include "unshuffle.h"
#pragma GCC pop_options
#endif
#undef KERNEL
#undef WIDE_VECTORS
#endif
#endif

#if VECTOR_KERNELS
#define KERNEL unshuffle_portable
#define WIDE_VECTORS 0
#include "unshuffle.h"
#undef KERNEL
#undef WIDE_VECTORS
#endif

int path_for(int path) {
    if (path >= 0) return path < NPATHS && runs[path] ? path : -1;
    for (int p = 0; p < NPATHS; p++)
        if (runs[p]) return p;
    return -1;
}

const char *decode(const header_t *h, const uint8_t *f, size_t len, uint8_t *dst, int op, int path, uint8_t *tmp) {
    const uint32_t block = h->block, nblocks = h->size / block;
    const int ts = h->typesize, nsplits = (h->flags & DONT_SPLIT) ? 1 : ts;
    const size_t stream = block / nsplits;
    if (HEADER + 4 * (size_t)nblocks > len) return "frame shorter than its block offsets";
    for (uint32_t b = 0; b < nblocks; b++) {
        const uint8_t *planes[4];
        size_t at = u32(f + HEADER + 4 * (size_t)b);
        for (int s = 0; s < nsplits; s++) {
            if (at > len || len - at < 4) return "block offset out of the frame";
            const int32_t csize = (int32_t)u32(f + at);
            at += 4;
            if (csize <= 0 || (size_t)csize > len - at) return "stream size out of the frame";
            if ((size_t)csize == stream) {
                planes[s] = f + at; /* stored raw: unshuffled from the frame itself */
            } else {
                uint8_t *out = tmp + s * stream;
                if (LZ4_decompress_safe((const char *)f + at, (char *)out, csize, (int)stream) != (int)stream)
                    return "lz4 stream does not decode to its size";
                planes[s] = out;
            }
            at += (size_t)csize;
        }
        if (nsplits == 1)
            for (int s = 1; s < ts; s++) planes[s] = planes[0] + s * (block / ts);
        uint8_t *out = dst + (size_t)b * block;
        switch (path) {
#if X86
        case PATH_AVX512: unshuffle_avx512(planes, out, block / ts, ts, op); break;
#if VECTOR_KERNELS
        case PATH_AVX2: unshuffle_avx2(planes, out, block / ts, ts, op); break;
#endif
#endif
#if VECTOR_KERNELS
        case PATH_PORTABLE: unshuffle_portable(planes, out, block / ts, ts, op); break;
#endif
        default: return "no such path in this build";
        }
    }
    return NULL;
}

void decoder_init(void) {
#if X86
    __builtin_cpu_init();
    runs[PATH_AVX512] = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
    runs[PATH_AVX2] = VECTOR_KERNELS && __builtin_cpu_supports("avx2");
#endif
}
