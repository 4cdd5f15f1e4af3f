/* The native decoder's C interface (decode.c), apart from Python: blosc1.c binds it to Python,
 * selftest.c runs it on its own (under qemu-user for other architectures). */
#ifndef AMBER_DECODE_H
#define AMBER_DECODE_H
#include <stddef.h>
#include <stdint.h>

/* c-blosc 1.x's frame: a 16-byte header, then one int32 offset per block; a block holds
 * `typesize` streams (one, if DONT_SPLIT), each an int32 size and lz4's output, or the raw
 * bytes when that size equals the stream's uncompressed size. */
enum { HEADER = 16, DOSHUFFLE = 0x1, MEMCPYED = 0x2, DOBITSHUFFLE = 0x4, DONT_SPLIT = 0x10, LZ4_FORMAT = 1 };
enum { OP_STORE = 0, OP_UNZIGZAG_ADD = 1 };

/* The decode paths, fastest first; a CPU runs those its `runs` marks (the portable one wherever
 * the compiler built it: GCC 12+ or Clang). */
enum { PATH_AVX512, PATH_AVX2, PATH_PORTABLE, NPATHS };
extern const char *const PATH_NAMES[NPATHS];
extern int runs[NPATHS];

/* A frame's header, copied out of the frame once (by the binding, with the GIL held): the decode
 * runs from these values only (the caller's buffer may change while it runs). */
typedef struct {
    uint8_t flags, typesize;
    uint32_t size, block;
} header_t;

/* Whether the frame's header is one this decoder takes, for an output of `nbytes` (and, unless 0,
 * elements of `typesize` bytes); if so, *h holds it. */
int read_header(const uint8_t *f, size_t len, size_t nbytes, int typesize, header_t *h);
/* The path this CPU decodes by (each takes 2- and 4-byte elements), or -1 (`path` >= 0: that
 * one, if this CPU runs it). */
int path_for(int path);
/* Decode the frame f (len bytes), whose header is h, into dst (h->size bytes) by `path` (one
 * path_for answered), with tmp a scratch buffer of h->block bytes. Returns NULL or the reason the
 * frame is corrupt. */
const char *decode(const header_t *h, const uint8_t *f, size_t len, uint8_t *dst, int op, int path, uint8_t *tmp);
/* Which paths this CPU runs (call once, first). */
void decoder_init(void);
#endif
