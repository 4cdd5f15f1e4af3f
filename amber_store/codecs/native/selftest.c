/* The native decoder on its own, without Python: decodes the cases named on the command line by
 * every path this CPU runs and compares the bits, checks the diff's host kernels (zigzag.c) on
 * the diffs, then decodes mutated copies of their frames, which must fail or decode without
 * writing past the output. Built for another architecture and
 * run under qemu-user by tests/test_native_decoder.py (cases written there by c-blosc).
 *
 * A case file: "AMBC", then op, nbytes and the frame's length (little-endian uint32 each), the
 * frame, the output's bytes before the decode (nbytes) and after it (nbytes).
 *
 *     selftest CASE... -> "<paths>: <n> cases, <m> mutated frames" on stdout, exit 0 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "zigzag.h"

enum { GUARD = 4096 };

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (buf && fread(buf, 1, *len, f) != *len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static uint32_t next(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)rng;
}

int main(int argc, char **argv) {
    decoder_init();
    int cases = 0, mutated = 0, used[NPATHS] = {0};
    for (int a = 1; a < argc; a++) {
        size_t len;
        uint8_t *c = slurp(argv[a], &len);
        if (!c || len < 16 || memcmp(c, "AMBC", 4)) {
            fprintf(stderr, "%s: not a case file\n", argv[a]);
            return 2;
        }
        const int op = (int)le32(c + 4);
        const size_t nbytes = le32(c + 8), flen = le32(c + 12);
        if (len != 16 + flen + 2 * nbytes) {
            fprintf(stderr, "%s: truncated\n", argv[a]);
            return 2;
        }
        const uint8_t *frame = c + 16, *before = frame + flen, *after = before + nbytes;
        header_t h;
        if (!read_header(frame, flen, nbytes, 0, &h)) {
            fprintf(stderr, "%s: a frame the decoder does not take\n", argv[a]);
            return 1;
        }
        uint8_t *out = malloc(nbytes + GUARD), *tmp = malloc(h.block);
        for (int p = 0; p < NPATHS; p++) {
            if (path_for(p) != p) continue;
            memcpy(out, before, nbytes);
            const char *err = decode(&h, frame, flen, out, op, p, tmp);
            if (err || memcmp(out, after, nbytes)) {
                fprintf(stderr, "%s: path %s: %s\n", argv[a], PATH_NAMES[p], err ? err : "other bits");
                return 1;
            }
            used[p] = 1;
        }
        if (op == OP_UNZIGZAG_ADD) { /* the kernels: the stored diff from the values, and back */
            uint8_t *z = malloc(nbytes), *d = malloc(nbytes);
            const size_t n = nbytes / h.typesize;
            if (decode(&h, frame, flen, z, OP_STORE, path_for(-1), tmp)) return 1;
            zigzag_diff(d, after, before, n, h.typesize);
            memcpy(out, before, nbytes);
            unzigzag_add(out, z, n, h.typesize);
            if (memcmp(d, z, nbytes) || memcmp(out, after, nbytes)) {
                fprintf(stderr, "%s: the zigzag kernels: other bits\n", argv[a]);
                return 1;
            }
            free(z);
            free(d);
        }
        uint8_t *bad = malloc(flen);
        for (int i = 0; i < 200; i++, mutated++) {
            memcpy(bad, frame, flen);
            size_t blen = flen;
            if (i % 3 == 0) blen = 16 + next() % (flen - 16);
            else
                for (int k = 1 + next() % 8; k > 0; k--) bad[16 + next() % (flen - 16)] = (uint8_t)next();
            memset(out + nbytes, 0xA5, GUARD);
            header_t hb;
            if (read_header(bad, blen, nbytes, 0, &hb)) {
                int p = path_for(-1);
                uint8_t *t = malloc(hb.block);
                (void)decode(&hb, bad, blen, out, i & 1, p, t);
                free(t);
            }
            for (int g = 0; g < GUARD; g++)
                if (out[nbytes + g] != 0xA5) {
                    fprintf(stderr, "%s: a mutated frame wrote past the output\n", argv[a]);
                    return 1;
                }
        }
        free(bad);
        free(out);
        free(tmp);
        free(c);
        cases++;
    }
    for (int p = 0, first = 1; p < NPATHS; p++)
        if (used[p]) printf(first ? "%s" : ",%s", PATH_NAMES[p]), first = 0;
    printf(": %d cases, %d mutated frames\n", cases, mutated);
    return cases ? 0 : 2;
}
