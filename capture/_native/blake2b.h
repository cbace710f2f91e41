/* BLAKE2b (RFC 7693), unkeyed, 16-byte digests (capture.ingest.content_hash). */
#ifndef CAPTURE_BLAKE2B_H
#define CAPTURE_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

/* The 16-byte digests of n messages (msg[i], len[i] bytes) into digests (16 * n bytes),
 * several at a time in vector registers. */
void blake2b16_many(const uint8_t *const *msg, const size_t *len, size_t n, uint8_t *digests);

#endif
