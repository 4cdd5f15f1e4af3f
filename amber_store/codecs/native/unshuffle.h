/* The bit-unshuffle of decode.c's avx2 and portable paths, included once per target it is compiled
 * for: plain C on vectors of four uint64 lanes (GCC/Clang vector extensions), so that the same
 * source runs as AVX2 on x86-64, NEON on aarch64 and SSE2 (or scalar code) elsewhere.
 *
 * The includer defines KERNEL and WIDE_VECTORS (1 where a register holds 32 bytes).
 *
 * Per 32 bytes of each of a byte's 8 bit rows (256 elements), every lane takes 8 columns: an 8x8
 * byte transpose across the rows gives, per column, its 8 rows' bytes in one uint64; an 8x8 bit
 * transpose inside it gives byte j of that column's 8 elements; the TS byte planes are then
 * interleaved into elements by byte shuffles. Nothing target-specific: the compiler picks the
 * instructions. */

#ifndef AMBER_V4_DEFINED
#define AMBER_V4_DEFINED
typedef uint64_t v4 __attribute__((vector_size(32), aligned(8)));
/* for loads and stores at any address (one unaligned vector move, not a copy through the stack) */
typedef uint64_t v4u __attribute__((vector_size(32), aligned(1), may_alias));
typedef uint32_t v8 __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v16 __attribute__((vector_size(32), aligned(2)));

#define SWAP(a, b, s, m)                    \
    do {                                    \
        v4 t_ = (((a) >> (s)) ^ (b)) & (m); \
        (a) ^= t_ << (s);                   \
        (b) ^= t_;                          \
    } while (0)
typedef uint8_t v32 __attribute__((vector_size(32), aligned(1)));
typedef uint64_t q2 __attribute__((vector_size(16), aligned(8)));
typedef uint8_t b16 __attribute__((vector_size(16), aligned(1)));
typedef uint16_t h8 __attribute__((vector_size(16), aligned(2)));
/* Interleave the bytes (16-bit units) of the low (high) quarters of a's and b's 16-byte halves:
 * x86's unpacks, NEON's zips. */
#define LO8(t, a, b) __builtin_shufflevector((t)(a), (t)(b), 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
#define HI8(t, a, b) __builtin_shufflevector((t)(a), (t)(b), 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
#define LO16(t, a, b) __builtin_shufflevector((t)(a), (t)(b), 0, 8, 1, 9, 2, 10, 3, 11)
#define HI16(t, a, b) __builtin_shufflevector((t)(a), (t)(b), 4, 12, 5, 13, 6, 14, 7, 15)
/* Where 32-byte vectors are two registers (SSE2, NEON), each half shuffled on its own: compilers
 * lower a 32-byte shuffle there element by element. */
#define BY_HALVES(op, t, a, b) ({ v4 a_ = (a), b_ = (b);                                            \
    q2 lo_ = (q2)op(t, __builtin_shufflevector(a_, a_, 0, 1), __builtin_shufflevector(b_, b_, 0, 1)); \
    q2 hi_ = (q2)op(t, __builtin_shufflevector(a_, a_, 2, 3), __builtin_shufflevector(b_, b_, 2, 3)); \
    (v4){lo_[0], lo_[1], hi_[0], hi_[1]}; })
/* Where they are one register (AVX2), the same as one shuffle of each half at once (one vpunpck) */
#define WHOLE8(a, b, lo) ((v4)__builtin_shufflevector((v32)(a), (v32)(b), lo, 32 + lo, 1 + lo, 33 + lo, 2 + lo, \
    34 + lo, 3 + lo, 35 + lo, 4 + lo, 36 + lo, 5 + lo, 37 + lo, 6 + lo, 38 + lo, 7 + lo, 39 + lo, 16 + lo, 48 + lo, \
    17 + lo, 49 + lo, 18 + lo, 50 + lo, 19 + lo, 51 + lo, 20 + lo, 52 + lo, 21 + lo, 53 + lo, 22 + lo, 54 + lo, \
    23 + lo, 55 + lo))
#define WHOLE16(a, b, lo) ((v4)__builtin_shufflevector((v16)(a), (v16)(b), lo, 16 + lo, 1 + lo, 17 + lo, 2 + lo, \
    18 + lo, 3 + lo, 19 + lo, 8 + lo, 24 + lo, 9 + lo, 25 + lo, 10 + lo, 26 + lo, 11 + lo, 27 + lo))
/* a's and b's low (high) 16-byte halves, side by side */
#define HALVES_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 4, 5)
#define HALVES_HI(a, b) __builtin_shufflevector(a, b, 2, 3, 6, 7)
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#endif

#undef UNPACKLO8
#undef UNPACKHI8
#undef UNPACKLO16
#undef UNPACKHI16
#if WIDE_VECTORS
#define UNPACKLO8(a, b) WHOLE8(a, b, 0)
#define UNPACKHI8(a, b) WHOLE8(a, b, 8)
#define UNPACKLO16(a, b) WHOLE16(a, b, 0)
#define UNPACKHI16(a, b) WHOLE16(a, b, 4)
#else
#define UNPACKLO8(a, b) BY_HALVES(LO8, b16, a, b)
#define UNPACKHI8(a, b) BY_HALVES(HI8, b16, a, b)
#define UNPACKLO16(a, b) BY_HALVES(LO16, h8, a, b)
#define UNPACKHI16(a, b) BY_HALVES(HI16, h8, a, b)
#endif

/* Bit-unshuffle one block of n elements of ts (2 or 4) bytes (n % 256 == 0) whose bit planes of
 * byte j lie at planes[j] (8 rows of n / 8 bytes), storing them into dst or applying them onto
 * it (op, as in decode.h). */
static inline __attribute__((always_inline)) void CAT(KERNEL, _of)(const uint8_t *const planes[4], uint8_t *dst,
                                                                  size_t n, const int ts, const int op) {
    const size_t rowlen = n / 8;
    for (size_t g = 0; g < rowlen; g += 32) {
        v4 Y[4][8];
        for (int j = 0; j < ts; j++) {
            v4 *R = Y[j];
            for (int b = 0; b < 8; b++) R[b] = *(const v4u *)(planes[j] + b * rowlen + g);
            /* 8x8 bytes: R[m]'s byte b <- R[b]'s byte m, in every lane */
            const v4 m32 = (v4){} + 0x00000000FFFFFFFFULL, m16 = (v4){} + 0x0000FFFF0000FFFFULL,
                     m8 = (v4){} + 0x00FF00FF00FF00FFULL;
            SWAP(R[0], R[4], 32, m32); SWAP(R[1], R[5], 32, m32); SWAP(R[2], R[6], 32, m32); SWAP(R[3], R[7], 32, m32);
            SWAP(R[0], R[2], 16, m16); SWAP(R[1], R[3], 16, m16); SWAP(R[4], R[6], 16, m16); SWAP(R[5], R[7], 16, m16);
            SWAP(R[0], R[1], 8, m8); SWAP(R[2], R[3], 8, m8); SWAP(R[4], R[5], 8, m8); SWAP(R[6], R[7], 8, m8);
            /* 8x8 bits inside each uint64: byte k's bit b <- byte b's bit k */
            for (int m = 0; m < 8; m++) {
                v4 x = R[m], t;
                t = ((x >> 28) ^ x) & 0x00000000F0F0F0F0ULL; x ^= t ^ (t << 28);
                t = ((x >> 14) ^ x) & 0x0000CCCC0000CCCCULL; x ^= t ^ (t << 14);
                t = ((x >> 7) ^ x) & 0x00AA00AA00AA00AAULL;  x ^= t ^ (t << 7);
                R[m] = x;
            }
        }
        /* Y[j][m], lane l: byte j of the 8 elements from 8 * (g + 8l + m). Interleaved by byte (and
         * 16-bit unit) within each 16-byte half, as x86's unpacks and NEON's zips do, then the
         * halves paired: 32 consecutive bytes of dst per vector. */
        uint8_t *d = dst + g * 8 * ts;
        for (int m = 0; m < 8; m += 4 / ts) {
            v4 V[4];
            if (ts == 2) { /* columns m and m + 1 */
                const v4 lo = UNPACKLO8(Y[0][m], Y[1][m]), hi = UNPACKHI8(Y[0][m], Y[1][m]);
                const v4 lo1 = UNPACKLO8(Y[0][m + 1], Y[1][m + 1]), hi1 = UNPACKHI8(Y[0][m + 1], Y[1][m + 1]);
                V[0] = HALVES_LO(lo, lo1); V[1] = HALVES_LO(hi, hi1); V[2] = HALVES_HI(lo, lo1); V[3] = HALVES_HI(hi, hi1);
            } else {
                const v4 ablo = UNPACKLO8(Y[0][m], Y[1][m]), abhi = UNPACKHI8(Y[0][m], Y[1][m]);
                const v4 cdlo = UNPACKLO8(Y[2][m], Y[3][m]), cdhi = UNPACKHI8(Y[2][m], Y[3][m]);
                const v4 x = UNPACKLO16(ablo, cdlo), y = UNPACKHI16(ablo, cdlo);
                const v4 x1 = UNPACKLO16(abhi, cdhi), y1 = UNPACKHI16(abhi, cdhi);
                V[0] = HALVES_LO(x, y); V[1] = HALVES_LO(x1, y1); V[2] = HALVES_HI(x, y); V[3] = HALVES_HI(x1, y1);
            }
            for (int l = 0; l < 4; l++) {
                uint8_t *at = d + (8 * l + m) * 8 * ts;
                v4u *out = (v4u *)at;
                if (op == OP_STORE) {
                    *out = V[l];
                } else if (ts == 4) { /* the diff's zigzag: 0, -1, 1, -2, ... <- 0, 1, 2, 3, ... */
                    v8 z = (v8)V[l];
                    *out = (v4)((v8)*out + ((z >> 1) ^ -(z & 1)));
                } else {
                    v16 z = (v16)V[l];
                    *out = (v4)((v16)*out + ((z >> 1) ^ -(z & 1)));
                }
            }
        }
    }
}

/* (each width and op compiled apart: loops over them unrolled, the vectors kept in registers) */
static void KERNEL(const uint8_t *const planes[4], uint8_t *dst, size_t n, int ts, int op) {
    if (ts == 4)
        op == OP_STORE ? CAT(KERNEL, _of)(planes, dst, n, 4, OP_STORE) : CAT(KERNEL, _of)(planes, dst, n, 4, OP_UNZIGZAG_ADD);
    else
        op == OP_STORE ? CAT(KERNEL, _of)(planes, dst, n, 2, OP_STORE) : CAT(KERNEL, _of)(planes, dst, n, 2, OP_UNZIGZAG_ADD);
}
