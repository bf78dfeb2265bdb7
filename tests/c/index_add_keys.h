/*
 * index_add_keys.h - the keys of the index_add window tests, shared by
 * tests/c/test_index.c (CPU, against the order worked out by hand) and
 * test_index_cuda.c (CUDA against the CPU, bit for bit).
 */
#ifndef INDEX_ADD_KEYS_H
#define INDEX_ADD_KEYS_H

#include <stdint.h>

/* A fixed shuffle (an LCG) of key[0..n). */
static void shuffle_keys(int64_t *key, int64_t n, uint64_t seed) {
  for (int64_t i = n - 1; i > 0; i--) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    int64_t j = (int64_t)((seed >> 33) % (uint64_t)(i + 1)), t = key[i];
    key[i] = key[j];
    key[j] = t;
  }
}

/* Keys of index_add's window tests. single (kind 0): key 2 m times after
 * `lead` entries of keys 0 and 1 (so its segment starts at sorted position
 * lead) and before 7 of key 3, shuffled (X = 4). skewed (1): about half of
 * the n keys are 32 (a frequent byte), the rest uniform in [0, X).
 * distinct (2): a permutation of [0, n) (X = n). Returns the key count. */
static int64_t window_keys(int64_t *key, int kind, int64_t m, int64_t lead, int64_t n, int64_t X,
                           uint64_t seed) {
  if (kind == 0) {
    int64_t c = 0;
    for (int64_t i = 0; i < lead; i++) key[c++] = i % 2;
    for (int64_t i = 0; i < m; i++) key[c++] = 2;
    for (int64_t i = 0; i < 7; i++) key[c++] = 3;
    shuffle_keys(key, c, seed);
    return c;
  }
  for (int64_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    uint64_t r = seed >> 33;
    key[i] = kind == 2 ? i : (r & 1) ? 32 : (int64_t)((r >> 1) % (uint64_t)X);
  }
  if (kind == 2) shuffle_keys(key, n, seed);
  return n;
}

#endif
