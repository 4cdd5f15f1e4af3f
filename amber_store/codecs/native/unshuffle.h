/* The portable bit-unshuffle of blosc1.c, included once per target it is compiled for (KERNEL names
 * the function): plain C on vectors of four uint64 lanes (GCC/Clang vector extensions), so that
 * the same source runs as AVX2 on x86-64, NEON on aarch64 and SSE2 (or scalar code) elsewhere.
 *
 * Per 32 bytes of each of a byte's 8 bit rows (256 elements), every lane takes 8 columns: an 8x8
 * byte transpose across the rows gives, per column, its 8 rows' bytes in one uint64; an 8x8 bit
 * transpose inside it gives byte j of that column's 8 elements; the TS byte planes are then
 * interleaved into elements. Only lane-wise shifts, masks and xors: nothing target-specific. */

#ifndef AMBER_V4_DEFINED
#define AMBER_V4_DEFINED
typedef uint64_t v4 __attribute__((vector_size(32), aligned(8)));
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
#define UNPACKLO8(a, b) BY_HALVES(LO8, b16, a, b)
#define UNPACKHI8(a, b) BY_HALVES(HI8, b16, a, b)
#define UNPACKLO16(a, b) BY_HALVES(LO16, h8, a, b)
#define UNPACKHI16(a, b) BY_HALVES(HI16, h8, a, b)
/* a's and b's low (high) 16-byte halves, side by side */
#define HALVES_LO(a, b) __builtin_shufflevector(a, b, 0, 1, 4, 5)
#define HALVES_HI(a, b) __builtin_shufflevector(a, b, 2, 3, 6, 7)
#endif

/* Bit-unshuffle one block of n elements of ts (2 or 4) bytes (n % 256 == 0) whose bit planes of
 * byte j lie at planes[j] (8 rows of n / 8 bytes), storing them into dst or applying them onto
 * it (op, as in blosc1.c). */
static void KERNEL(const uint8_t *const planes[4], uint8_t *dst, size_t n, int ts, int op) {
    const size_t rowlen = n / 8;
    for (size_t g = 0; g < rowlen; g += 32) {
        v4 Y[4][8];
        for (int j = 0; j < ts; j++) {
            v4 *R = Y[j];
            for (int b = 0; b < 8; b++) memcpy(&R[b], planes[j] + b * rowlen + g, 32);
            /* 8x8 bytes: R[m]'s byte b <- R[b]'s byte m, in every lane */
            for (int b = 0; b < 4; b++) SWAP(R[b], R[b + 4], 32, (v4){} + 0x00000000FFFFFFFFULL);
            for (int b = 0; b < 8; b += (b & 1) ? 3 : 1) SWAP(R[b], R[b + 2], 16, (v4){} + 0x0000FFFF0000FFFFULL);
            for (int b = 0; b < 8; b += 2) SWAP(R[b], R[b + 1], 8, (v4){} + 0x00FF00FF00FF00FFULL);
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
                if (op == OP_STORE) {
                    memcpy(at, &V[l], 32);
                } else if (ts == 4) { /* the diff's zigzag: 0, -1, 1, -2, ... <- 0, 1, 2, 3, ... */
                    v8 z = (v8)V[l], v;
                    memcpy(&v, at, 32);
                    v += (z >> 1) ^ -(z & 1);
                    memcpy(at, &v, 32);
                } else {
                    v16 z = (v16)V[l], v;
                    memcpy(&v, at, 32);
                    v += (z >> 1) ^ -(z & 1);
                    memcpy(at, &v, 32);
                }
            }
        }
    }
}
