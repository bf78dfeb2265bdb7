/*
 * moe_data.h - Megatron-LM indexed datasets (the MMIDIDX ".bin"/".idx"
 * pair of megatron/core/datasets/indexed_dataset.py): a memory-mapped reader
 * and a streaming writer. Implemented in core/dataset.c (CPU only: tokens
 * are read into i64 CPU tensors and moved to a GPU by the caller).
 *
 * Layout of prefix.idx (little endian):
 *   magic "MMIDIDX\0\0" (9 bytes), version u64 = 1, dtype code u8,
 *   sequence count n u64, document count c u64 (= documents + 1),
 *   sizes i32[n] (tokens per sequence), pointers i64[n] (byte offset of
 *   each sequence in prefix.bin), document indices i64[c] (the first
 *   sequence of each document, then n), optionally modes i8[n].
 * Dtype codes: 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16 (6 and
 * 7 are rejected: token ids are integers). prefix.bin holds the tokens.
 *
 * The reader validates everything against the file lengths once, at open
 * (magic, version, dtype, counts, every size, pointer and document index):
 * a corrupt or truncated file fails with MOE_ERR_IO naming the file and what
 * is wrong (the first sequence that overruns prefix.bin, or that starts
 * before the previous non-empty one ends: overlapping or out-of-order
 * sequences); nothing later can read outside the mapping. A named pipe, a
 * folder or a device in place of either file is refused without blocking.
 */
#ifndef MOE_DATA_H
#define MOE_DATA_H

#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_indexed_dataset moe_indexed_dataset;

/* Token dtype codes of the format. */
typedef enum moe_index_dtype {
  MOE_INDEX_U8 = 1,
  MOE_INDEX_I8 = 2,
  MOE_INDEX_I16 = 3,
  MOE_INDEX_I32 = 4,
  MOE_INDEX_I64 = 5,
  MOE_INDEX_F64 = 6,
  MOE_INDEX_F32 = 7,
  MOE_INDEX_U16 = 8
} moe_index_dtype;

/* "u8" "i8" "i16" "i32" "i64" "u16" <-> codes; false / NULL when unknown. */
bool moe_index_dtype_parse(const char *name, moe_index_dtype *out);
const char *moe_index_dtype_name(moe_index_dtype code);

moe_status moe_indexed_dataset_open(moe_ctx *ctx, const char *prefix, moe_indexed_dataset **out);
void moe_indexed_dataset_close(moe_indexed_dataset *ds); /* NULL: no-op */

int64_t moe_indexed_dataset_num_sequences(const moe_indexed_dataset *ds);
int64_t moe_indexed_dataset_num_documents(const moe_indexed_dataset *ds);
int64_t moe_indexed_dataset_num_tokens(const moe_indexed_dataset *ds);
moe_index_dtype moe_indexed_dataset_dtype(const moe_indexed_dataset *ds);
/* Tokens of sequence i (0 <= i < n). */
int64_t moe_indexed_dataset_size(const moe_indexed_dataset *ds, int64_t i);
/* First token of sequence i in the concatenation of all sequences (i <= n). */
int64_t moe_indexed_dataset_token_offset(const moe_indexed_dataset *ds, int64_t i);
/* First sequence of document d (d <= number of documents: gives n). */
int64_t moe_indexed_dataset_document_start(const moe_indexed_dataset *ds, int64_t d);

/* Tokens [offset, offset + length) of sequence i as a (length) i64 CPU
 * tensor; length < 0: to the end of the sequence. */
moe_status moe_indexed_dataset_get(moe_ctx *ctx, const moe_indexed_dataset *ds, int64_t i,
                                   int64_t offset, int64_t length, moe_tensor **out);

/* Windows of the token stream made of sequences [seq_begin, seq_end)
 * concatenated: row b of the (B, len) i64 CPU tensor holds stream tokens
 * [starts[b], starts[b] + len). Every window must lie inside the stream. */
moe_status moe_indexed_dataset_windows(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                       int64_t seq_begin, int64_t seq_end, const int64_t *starts,
                                       int64_t B, int64_t len, moe_tensor **out);

/* Entropy in nats of the unigram distribution of the tokens of sequences
 * [seq_begin, seq_end) (the loss of the best context-free predictor). */
moe_status moe_indexed_dataset_unigram_entropy(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                               int64_t seq_begin, int64_t seq_end, double *out);

/* Checks that every token id is in [0, vocab_size): the first that is not
 * fails with MOE_ERR_INVALID_ARG naming prefix.bin, the sequence, the
 * token's position in it and the id. One pass over the tokens (a typed
 * min/max per sequence, several GB/s). *max_id (may be NULL): the largest
 * id, -1 for a dataset without tokens. */
moe_status moe_indexed_dataset_check_vocab(moe_ctx *ctx, const moe_indexed_dataset *ds,
                                           int64_t vocab_size, int64_t *max_id);

/* ------------------------------------------------------------ writer */

typedef struct moe_indexed_builder moe_indexed_builder;

/* Creates prefix.bin.tmp-<pid> (tokens are streamed to it); finalize writes
 * prefix.idx.tmp-<pid>, fsyncs both and renames them to prefix.bin, then
 * prefix.idx. Until then an existing prefix.bin/.idx is untouched, and a
 * reader that has it open keeps reading the old contents after the rename. */
moe_status moe_indexed_builder_open(moe_ctx *ctx, const char *prefix, moe_index_dtype dtype,
                                    moe_indexed_builder **out);
/* Appends one sequence of n tokens; each must fit the dtype. */
moe_status moe_indexed_builder_add(moe_ctx *ctx, moe_indexed_builder *b, const int64_t *tokens,
                                   int64_t n);
/* Ends the current document (after the sequences added since the last end). */
moe_status moe_indexed_builder_end_document(moe_ctx *ctx, moe_indexed_builder *b);
/* Flushes prefix.bin and writes prefix.idx; the builder stays valid to free. */
moe_status moe_indexed_builder_finalize(moe_ctx *ctx, moe_indexed_builder *b);
/* Frees; an unfinalized builder removes the temporary file it created.
 * NULL: no-op. */
void moe_indexed_builder_free(moe_indexed_builder *b);

#ifdef __cplusplus
}
#endif
#endif /* MOE_DATA_H */
