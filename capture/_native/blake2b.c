/* BLAKE2b as RFC 7693 describes it (sections 2.4, 3.1-3.3), written from the text. */
#include <string.h>

#include "blake2b.h"

/* The SHA-512 initialization vector (RFC 7693 section 2.6). */
static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

/* Message word permutations, one per round (rounds 10 and 11 reuse 0 and 1). */
static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load64_le(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
#endif
}

/* The mixing function G (section 3.1) on v[], vectors of one word of each lane. */
#define ROTR(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)                                                                                           \
    do {                                                                                                              \
        v[a] = v[a] + v[b] + (x);                                                                                     \
        v[d] = ROTR(v[d] ^ v[a], 32);                                                                                 \
        v[c] = v[c] + v[d];                                                                                           \
        v[b] = ROTR(v[b] ^ v[c], 24);                                                                                 \
        v[a] = v[a] + v[b] + (y);                                                                                     \
        v[d] = ROTR(v[d] ^ v[a], 16);                                                                                 \
        v[c] = v[c] + v[d];                                                                                           \
        v[b] = ROTR(v[b] ^ v[c], 63);                                                                                 \
    } while (0)

/* Round r of F (section 3.2) over v[] and the message words m[]: the permutation indices are
 * constants, so the words stay in registers. */
#define ROUND(r)                                                                                                      \
    do {                                                                                                              \
        G(0, 4, 8, 12, m[SIGMA[r][0]], m[SIGMA[r][1]]);                                                               \
        G(1, 5, 9, 13, m[SIGMA[r][2]], m[SIGMA[r][3]]);                                                               \
        G(2, 6, 10, 14, m[SIGMA[r][4]], m[SIGMA[r][5]]);                                                              \
        G(3, 7, 11, 15, m[SIGMA[r][6]], m[SIGMA[r][7]]);                                                              \
        G(0, 5, 10, 15, m[SIGMA[r][8]], m[SIGMA[r][9]]);                                                              \
        G(1, 6, 11, 12, m[SIGMA[r][10]], m[SIGMA[r][11]]);                                                            \
        G(2, 7, 8, 13, m[SIGMA[r][12]], m[SIGMA[r][13]]);                                                             \
        G(3, 4, 9, 14, m[SIGMA[r][14]], m[SIGMA[r][15]]);                                                             \
    } while (0)
#define ROUNDS()                                                                                                      \
    do {                                                                                                              \
        ROUND(0);                                                                                                     \
        ROUND(1);                                                                                                     \
        ROUND(2);                                                                                                     \
        ROUND(3);                                                                                                     \
        ROUND(4);                                                                                                     \
        ROUND(5);                                                                                                     \
        ROUND(6);                                                                                                     \
        ROUND(7);                                                                                                     \
        ROUND(8);                                                                                                     \
        ROUND(9);                                                                                                     \
        ROUND(10);                                                                                                    \
        ROUND(11);                                                                                                    \
    } while (0)

/* ---- many messages at once ---------------------------------------------------------
 *
 * LANES messages advance side by side, a block each per step: word j of every lane sits in
 * one vector, so each step of G works on all lanes. The vectors are GCC's generic ones; with
 * target_clones the compiler builds the step for AVX-512, AVX2 and the baseline (SSE2 on
 * x86-64) and picks one when the module loads. */

#define LANES 8
typedef uint64_t lanes_t __attribute__((vector_size(8 * LANES)));

#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* F on one block per lane: h[j][lane] the states, m[j][lane] the blocks' words, t the byte
 * counts (below 2^64), f all ones in the lanes whose block is their last. */
CLONES static void compress_lanes(uint64_t h[8][LANES], uint64_t m_words[16][LANES], const uint64_t t[LANES],
                                  const uint64_t f[LANES]) {
    lanes_t v[16], m[16], tv, fv;
    for (int j = 0; j < 8; j++) {
        memcpy(&v[j], h[j], sizeof v[j]);
        v[j + 8] = (lanes_t){0} + IV[j];
    }
    for (int j = 0; j < 16; j++)
        memcpy(&m[j], m_words[j], sizeof m[j]);
    memcpy(&tv, t, sizeof tv);
    memcpy(&fv, f, sizeof fv);
    v[12] ^= tv;
    v[14] ^= fv;
    ROUNDS();
    for (int j = 0; j < 8; j++) {
        lanes_t hj;
        memcpy(&hj, h[j], sizeof hj);
        hj ^= v[j] ^ v[j + 8];
        memcpy(h[j], &hj, sizeof hj);
    }
}

void blake2b16_many(const uint8_t *const *msg, const size_t *len, size_t n, uint8_t *digests) {
    uint64_t h[8][LANES], m[16][LANES], t[LANES], f[LANES];
    size_t which[LANES], done[LANES], next = 0;
    int active[LANES], busy = 0;
    uint8_t pad[128];
    for (int i = 0; i < LANES; i++) {
        active[i] = 0;
        which[i] = done[i] = 0;
        t[i] = f[i] = 0;
        for (int j = 0; j < 8; j++)
            h[j][i] = 0;
    }
    for (;;) {
        for (int i = 0; i < LANES; i++) {
            if (!active[i] && next < n) { /* a free lane takes the next message */
                active[i] = 1;
                which[i] = next++;
                done[i] = 0;
                t[i] = 0;
                for (int j = 0; j < 8; j++)
                    h[j][i] = IV[j];
                h[0][i] ^= 0x01010000ULL ^ 16; /* digest length 16, no key, fanout 1, depth 1 */
            }
            if (!active[i]) { /* idle lane: computes on zeros, read by no one */
                f[i] = 0;
                for (int j = 0; j < 16; j++)
                    m[j][i] = 0;
                continue;
            }
            size_t rem = len[which[i]] - done[i];
            const uint8_t *block = msg[which[i]] + done[i];
            if (rem > 128) { /* the last block is compressed as such, even a full one */
                rem = 128;
                f[i] = 0;
            } else {
                memset(pad, 0, sizeof pad);
                if (rem)
                    memcpy(pad, block, rem);
                block = pad;
                f[i] = ~0ULL;
            }
            done[i] += rem;
            t[i] += rem;
            for (int j = 0; j < 16; j++)
                m[j][i] = load64_le(block + 8 * j);
        }
        busy = 0;
        for (int i = 0; i < LANES; i++)
            busy |= active[i];
        if (!busy)
            return;
        compress_lanes(h, m, t, f);
        for (int i = 0; i < LANES; i++)
            if (active[i] && f[i]) {
                uint8_t *d = digests + 16 * which[i];
                for (int k = 0; k < 16; k++)
                    d[k] = (uint8_t)(h[k / 8][i] >> (8 * (k % 8)));
                active[i] = 0;
            }
    }
}
