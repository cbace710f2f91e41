/* BLAKE2b (RFC 7693), unkeyed, digests of 1 to 64 bytes. */
#ifndef CAPTURE_BLAKE2B_H
#define CAPTURE_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t h[8];      /* chained state */
    uint64_t t[2];      /* bytes compressed so far (128-bit counter) */
    uint8_t block[128]; /* input not yet compressed */
    size_t filled;      /* bytes in block */
    size_t digest_size;
} Blake2b;

void blake2b_init(Blake2b *s, size_t digest_size);
void blake2b_update(Blake2b *s, const void *data, size_t n);
void blake2b_final(Blake2b *s, uint8_t *digest);

/* The 16-byte digests of n messages (msg[i], len[i] bytes) into digests (16 * n bytes),
 * several at a time in vector registers. */
void blake2b16_many(const uint8_t *const *msg, const size_t *len, size_t n, uint8_t *digests);

#endif
