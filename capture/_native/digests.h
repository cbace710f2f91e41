/* A set of 16-byte digests in one caller-owned buffer (open addressing, linear probing).
 *
 * Layout: a 16-byte header, then a power-of-two number of 16-byte slots. An all-zero slot
 * is empty; the all-zero digest itself is recorded by header byte 0. The caller keeps the
 * table at most half full (digests_rehash into a larger buffer), so probes stay short. */
#ifndef CAPTURE_DIGESTS_H
#define CAPTURE_DIGESTS_H

#include <stddef.h>
#include <stdint.h>

/* Adds d; returns 1 if it was new, 0 if already there, -1 if the table is full. slots: a power of two. */
int digests_add(uint8_t *table, size_t slots, const uint8_t d[16]);
/* Whether d is in the table. */
int digests_contains(const uint8_t *table, size_t slots, const uint8_t d[16]);
/* Inserts every digest of old_table into the empty new_table. */
void digests_rehash(const uint8_t *old_table, size_t old_slots, uint8_t *new_table, size_t new_slots);
/* 32 lowercase hex characters to 16 bytes; 0 if the text is not that. */
int digest_from_hex(const uint8_t *hex, size_t n, uint8_t out[16]);

#endif
