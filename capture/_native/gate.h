/* The redaction gate (capture.redact.GATE) in one pass over a string's bytes. */
#ifndef CAPTURE_GATE_H
#define CAPTURE_GATE_H

#include <stddef.h>
#include <stdint.h>

/* 1 where capture.redact.GATE (RE2, UTF-8) may match s[0, n), 0 where it certainly does not:
 * every string GATE matches is flagged; a string that holds the Kelvin sign (U+212A) or the
 * long s (U+017F), which (?i) folds to k and s, is flagged whatever else it holds.
 * `limit` is the end of the readable memory around s (s + n <= limit): whole 16-byte
 * blocks are loaded up to it, and the bytes beyond s + n are ignored. */
int gate_match(const uint8_t *s, size_t n, const uint8_t *limit);

#endif
