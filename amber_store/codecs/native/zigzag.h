/* The lossless diff's host kernels (zigzag.c): one pass per chunk, for the elements the native
 * decoder does not apply while it unshuffles (a save's every diff; a load's 1- and 8-byte
 * elements, zstd-framed packs, chunks c-blosc decodes). */
#ifndef AMBER_ZIGZAG_H
#define AMBER_ZIGZAG_H
#include <stddef.h>

/* out = zigzag(value - base) of n unsigned ints of `width` (1, 2, 4 or 8) bytes, modulo
 * 2**(8 * width): 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... */
void zigzag_diff(void *out, const void *value, const void *base, size_t n, int width);
/* out += unzigzag(stored), modulo 2**(8 * width): zigzag_diff's inverse. */
void unzigzag_add(void *out, const void *stored, size_t n, int width);
#endif
