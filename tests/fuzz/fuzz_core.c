/*
 * fuzz_core.c - runs the C parsers of the core on inputs the fuzzer
 * (tests/fuzz/fuzz.lua) wrote, and says what each did, so that a crash, a
 * sanitizer report or a hang costs one input, not the run.
 *
 *   fuzz_core TARGET DIR FIRST LAST [TIMEOUT_S]
 *       input i (FIRST <= i <= LAST) is the files DIR/<i>.<name>; prints one
 *       line per input: "<i> clean|load|crash|hang <detail>"
 *   fuzz_core --sanitized
 *       prints 1 in the ASan build, else 0
 *   fuzz_core TARGET --one PREFIX [TIMEOUT_S]
 *       one input, the files PREFIX<name> (a saved failure: "FOLDER/"), the
 *       same line with i = 0
 *
 * Targets and the file names of an input:
 *   safetensors  model.safetensors   moe_safetensors_load on the CPU; a load
 *                                    reads every byte of every tensor
 *   json         input.json          moe_json_parse on a buffer of exactly the
 *                                    file's size (ASan sees a read past it);
 *                                    a parse walks the whole tree
 *   dataset      data.idx, data.bin  moe_indexed_dataset_open; an open reads
 *                                    every token (get, windows) and checks
 *                                    each accepted sequence against the .bin
 *                                    by its own reading of the .idx
 *   selftest     input.json          does what the file names (segv, hang,
 *                                    leak, ...): fuzz.lua's check that each
 *                                    kind of failure is seen
 *
 * Outcomes: clean = the parser returned an error with a message of the
 * expected form; load = it succeeded and the checks of the result held;
 * crash = a signal, a sanitizer report (ASan/UBSan exit with a report on
 * stderr, LeakSanitizer at exit), an out-of-memory error (inputs are small,
 * so an allocation that fails under the 1 GiB limit is a bug), a peak
 * resident memory that grew by more than 256 MiB during the input, an error
 * without the expected message, or a result that fails a check; hang = the
 * input ran past TIMEOUT_S seconds (default 10).
 *
 * Inputs run in batches in a forked child that reports each outcome on a
 * pipe. When the child dies, the input it was on is the crash (SIGALRM: the
 * hang) and a new child goes on with the next one. A child that reported
 * every outcome but exited non-zero (LeakSanitizer at exit) has its inputs
 * run again one child each, to name the one that leaks. A child's stderr
 * goes to DIR/log.<first input of the child>; a crash's line names that log.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "json.h"
#include "moe.h"
#include "moe_data.h"
#include "moe_io.h"

#define FZ_BATCH 64
#define FZ_MEM_LIMIT ((size_t)1 << 30)  /* bytes of address space over the start (normal build) */
#define FZ_MAX_TOKENS ((int64_t)1 << 16) /* tokens read back from an opened dataset */
#define FZ_RSS_GROWTH_MB 256 /* peak resident memory one small input may add */

#if defined(__SANITIZE_ADDRESS__)
#define FZ_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FZ_ASAN 1
#endif
#endif

#ifdef FZ_ASAN
/* An allocation over 1 GiB returns NULL (and the parser an out-of-memory
 * error, which counts as a crash) rather than ending the child without a
 * word; ASAN_OPTIONS given at run time still apply over these. */
__attribute__((used, visibility("default"))) const char *__asan_default_options(void);
const char *__asan_default_options(void) {
  return "allocator_may_return_null=1:max_allocation_size_mb=1024";
}
#endif

typedef enum { FZ_CLEAN, FZ_LOAD, FZ_CRASH } fz_outcome;

typedef struct fz_result {
  fz_outcome outcome;
  char detail[400];
} fz_result;

static fz_outcome fz_set(fz_result *r, fz_outcome o, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static fz_outcome fz_set(fz_result *r, fz_outcome o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->detail, sizeof r->detail, fmt, ap);
  va_end(ap);
  for (char *c = r->detail; *c; c++)
    if (*c == '\n' || *c == '\r') *c = ' ';
  r->outcome = o;
  return o;
}

/* The whole file in a malloc'd buffer of exactly its size (1 byte for an
 * empty file, never read). NULL when it cannot be read. */
static unsigned char *fz_read(const char *path, size_t *n) {
  *n = 0;
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0) {
    fclose(f);
    return NULL;
  }
  size_t len = (size_t)sb.st_size;
  unsigned char *b = malloc(len ? len : 1);
  if (b && len && fread(b, 1, len, f) != len) {
    free(b);
    b = NULL;
  }
  fclose(f);
  *n = len;
  return b;
}

/* The error of a failed parse: clean when the message has the parser's
 * prefix; an out-of-memory status or another message is a crash. */
static fz_outcome fz_error(fz_result *r, moe_ctx *ctx, moe_status st, const char *prefix) {
  const char *msg = moe_ctx_error(ctx);
  if (st == MOE_ERR_OUT_OF_MEMORY)
    return fz_set(r, FZ_CRASH, "out of memory on a small input (a huge allocation): %s", msg);
  if (strncmp(msg, prefix, strlen(prefix)) != 0 || strlen(msg) <= strlen(prefix))
    return fz_set(r, FZ_CRASH, "error without the expected '%s' message (%s): %s", prefix,
                  moe_status_name(st), msg);
  return fz_set(r, FZ_CLEAN, "%s", msg);
}

/* ------------------------------------------------------------ safetensors */

static fz_outcome fz_safetensors(moe_ctx *ctx, const char *dir, fz_result *r) {
  char path[4400];
  snprintf(path, sizeof path, "%smodel.safetensors", dir);
  moe_safetensors *f = NULL;
  moe_status st = moe_safetensors_load(ctx, path, MOE_CPU, &f);
  if (st != MOE_OK) return fz_error(r, ctx, st, "load: '");
  unsigned sum = 0;
  int64_t n = moe_safetensors_count(f), bytes = 0;
  for (int64_t i = 0; i < n; i++) {
    const char *name = moe_safetensors_name(f, i);
    moe_tensor *t = moe_safetensors_tensor(f, i);
    if (!name || !t || moe_safetensors_get(f, name) != t) {
      moe_safetensors_free(f);
      return fz_set(r, FZ_CRASH, "loaded entry %lld has no name or tensor", (long long)i);
    }
    size_t nb = (size_t)moe_tensor_numel(t) * moe_dtype_size(t->dtype);
    const unsigned char *p = moe_tensor_data(t);
    for (size_t k = 0; k < nb; k++) sum += p[k];
    bytes += (int64_t)nb;
  }
  for (int64_t i = 0; i < moe_safetensors_metadata_count(f); i++)
    sum += (unsigned)strlen(moe_safetensors_metadata_key(f, i)) +
           (unsigned)strlen(moe_safetensors_metadata_value(f, i));
  moe_safetensors_free(f);
  return fz_set(r, FZ_LOAD, "%lld tensors, %lld bytes (sum %u)", (long long)n, (long long)bytes,
                sum);
}

/* ------------------------------------------------------------ json */

/* Checks every node; returns false with a message at the first bad one. */
static bool fz_json_walk(const moe_json *v, size_t len, int depth, char *why, size_t wl) {
  if (depth > MOE_JSON_MAX_DEPTH + 1) return snprintf(why, wl, "tree deeper than the limit"), false;
  if (v->offset > len) return snprintf(why, wl, "offset %zu past the text", (size_t)v->offset), false;
  switch (v->type) {
    case MOE_JSON_STRING:
      if (!v->str || strlen(v->str) != v->len || !moe_utf8_valid(v->str, v->len))
        return snprintf(why, wl, "string at %zu: bad length or UTF-8", (size_t)v->offset), false;
      return true;
    case MOE_JSON_ARRAY:
    case MOE_JSON_OBJECT:
      for (size_t i = 0; i < v->n; i++) {
        if (v->type == MOE_JSON_OBJECT &&
            (!v->keys[i] || !moe_utf8_valid(v->keys[i], strlen(v->keys[i]))))
          return snprintf(why, wl, "object at %zu: bad key %zu", (size_t)v->offset, i), false;
        if (!fz_json_walk(&v->items[i], len, depth + 1, why, wl)) return false;
      }
      return true;
    default:
      return true;
  }
}

static fz_outcome fz_json(const char *dir, fz_result *r) {
  char path[4400];
  snprintf(path, sizeof path, "%sinput.json", dir);
  size_t len = 0;
  unsigned char *text = fz_read(path, &len);
  if (!text) return fz_set(r, FZ_CRASH, "fuzz_core: cannot read %s", path);
  moe_json *root = NULL;
  char err[256] = "", why[128] = "";
  size_t at = (size_t)-1;
  bool ok = moe_json_parse((const char *)text, len, &root, &at, err, sizeof err);
  fz_outcome o;
  if (!ok) {
    if (!err[0] || at > len || root)
      o = fz_set(r, FZ_CRASH, "bad error report: offset %zu of %zu, message '%s'", at, len, err);
    else
      o = fz_set(r, FZ_CLEAN, "at byte %zu: %s", at, err);
  } else if (!root || !fz_json_walk(root, len, 0, why, sizeof why)) {
    o = fz_set(r, FZ_CRASH, "parsed tree fails a check: %s", root ? why : "no root");
  } else {
    o = fz_set(r, FZ_LOAD, "%s", moe_json_type_name(root->type));
  }
  moe_json_free(root);
  free(text);
  return o;
}

/* ------------------------------------------------------------ dataset */

/* The fuzzer's own reading of an accepted .idx: every sequence must lie
 * inside the .bin, and the counts must be what the reader reports. */
static bool fz_dataset_oracle(const moe_indexed_dataset *ds, const unsigned char *idx, size_t idx_len,
                              size_t bin_len, char *why, size_t wl) {
  static const int64_t itemsize[] = {0, 1, 1, 2, 4, 8, 8, 4, 2};
  if (idx_len < 34 || idx[17] < 1 || idx[17] > 8)
    return snprintf(why, wl, "accepted a header of %zu bytes / dtype %u", idx_len, idx[17]), false;
  int64_t isz = itemsize[idx[17]];
  uint64_t n, c;
  memcpy(&n, idx + 18, 8);
  memcpy(&c, idx + 26, 8);
  if (n != (uint64_t)moe_indexed_dataset_num_sequences(ds) ||
      c != (uint64_t)moe_indexed_dataset_num_documents(ds) + 1)
    return snprintf(why, wl, "counts differ from the file's"), false;
  if (34 + 12 * n + 8 * c > idx_len) return snprintf(why, wl, "arrays past the .idx"), false;
  for (uint64_t i = 0; i < n; i++) {
    int32_t sz;
    int64_t p;
    memcpy(&sz, idx + 34 + 4 * i, 4);
    memcpy(&p, idx + 34 + 4 * n + 8 * i, 8);
    if (sz < 0 || p < 0 || (uint64_t)p + (uint64_t)sz * (uint64_t)isz > bin_len)
      return snprintf(why, wl, "accepted sequence %llu (%d tokens at byte %lld) outside the .bin of %zu bytes",
                      (unsigned long long)i, sz, (long long)p, bin_len), false;
    if (moe_indexed_dataset_size(ds, (int64_t)i) != sz)
      return snprintf(why, wl, "size of sequence %llu differs", (unsigned long long)i), false;
  }
  return true;
}

static fz_outcome fz_dataset(moe_ctx *ctx, const char *dir, fz_result *r) {
  char prefix[4400], path[4500];
  snprintf(prefix, sizeof prefix, "%sdata", dir);
  moe_indexed_dataset *ds = NULL;
  moe_status st = moe_indexed_dataset_open(ctx, prefix, &ds);
  if (st != MOE_OK) return fz_error(r, ctx, st, "indexed dataset: ");
  size_t idx_len = 0, bin_len = 0;
  snprintf(path, sizeof path, "%s.idx", prefix);
  unsigned char *idx = fz_read(path, &idx_len);
  snprintf(path, sizeof path, "%s.bin", prefix);
  free(fz_read(path, &bin_len));
  char why[256] = "";
  bool ok = idx && fz_dataset_oracle(ds, idx, idx_len, bin_len, why, sizeof why);
  free(idx);
  if (!ok) {
    moe_indexed_dataset_close(ds);
    return fz_set(r, FZ_CRASH, "dataset opened but %s", why[0] ? why : "its .idx cannot be read back");
  }
  int64_t n = moe_indexed_dataset_num_sequences(ds), total = moe_indexed_dataset_num_tokens(ds);
  uint64_t sum = 0; /* wraps: only a use of every value */
  int64_t read = 0;
  for (int64_t i = 0; i < n && read < FZ_MAX_TOKENS && st == MOE_OK; i++) {
    moe_tensor *t = NULL;
    st = moe_indexed_dataset_get(ctx, ds, i, 0, -1, &t);
    if (st != MOE_OK) break;
    const int64_t *v = moe_tensor_data(t);
    for (int64_t k = 0; k < moe_tensor_numel(t); k++) sum += (uint64_t)v[k];
    read += moe_tensor_numel(t);
    moe_tensor_release(t);
  }
  if (st == MOE_OK && total > 0 && total <= FZ_MAX_TOKENS) {
    int64_t starts[2] = {0, total / 2};
    moe_tensor *w = NULL;
    st = moe_indexed_dataset_windows(ctx, ds, 0, n, starts, 2, total - total / 2, &w);
    if (st == MOE_OK) {
      const int64_t *v = moe_tensor_data(w);
      for (int64_t k = 0; k < moe_tensor_numel(w); k++) sum += (uint64_t)v[k];
    }
    moe_tensor_release(w);
  }
  for (int64_t d = 0; st == MOE_OK && d <= moe_indexed_dataset_num_documents(ds); d++)
    sum += (uint64_t)moe_indexed_dataset_document_start(ds, d);
  moe_indexed_dataset_close(ds);
  if (st != MOE_OK)
    return fz_set(r, FZ_CRASH, "dataset opened but reading it failed: %s", moe_ctx_error(ctx));
  return fz_set(r, FZ_LOAD, "%lld sequences, %lld tokens (sum %llu)", (long long)n,
                (long long)total, (unsigned long long)sum);
}

/* ------------------------------------------------------------ selftest */

/* Does what input.json names, so that fuzz.lua's selftest can check that
 * each kind of failure is seen: clean, load, segv, abort, hang, oom (a
 * 3 GiB allocation must fail under the limit), badmsg, and in the
 * sanitizer build oob (a heap read past the end), ubsan (a signed
 * overflow), leak; rss (300 MiB touched, then freed). */
void *volatile fz_leak_sink; /* the selftest's leak: set, then dropped */

static fz_outcome fz_selftest(moe_ctx *ctx, const char *dir, fz_result *r) {
  char path[4400];
  snprintf(path, sizeof path, "%sinput.json", dir);
  size_t len = 0;
  char *w = (char *)fz_read(path, &len);
  if (!w) return fz_set(r, FZ_CRASH, "fuzz_core: cannot read %s", path);
  char what[16] = "";
  snprintf(what, sizeof what, "%.*s", (int)(len < 15 ? len : 15), w);
  free(w);
  if (strcmp(what, "clean") == 0) return fz_set(r, FZ_CLEAN, "a clean error");
  if (strcmp(what, "segv") == 0) raise(SIGSEGV);
  if (strcmp(what, "abort") == 0) abort();
  if (strcmp(what, "hang") == 0)
    for (volatile unsigned long k = 0;; k++) {
    }
  if (strcmp(what, "oom") == 0) {
    volatile size_t big = (size_t)3 << 30;
    void *p = malloc(big);
    if (p) {
      free(p);
      return fz_set(r, FZ_LOAD, "a 3 GiB allocation succeeded: no memory limit");
    }
    return fz_error(r, ctx, moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "selftest: out of memory"), "selftest: ");
  }
  if (strcmp(what, "badmsg") == 0)
    return fz_error(r, ctx, moe_error(ctx, MOE_ERR_IO, "no prefix"), "selftest: ");
  if (strcmp(what, "oob") == 0) {
    volatile size_t four = 4;
    unsigned char *p = malloc(four);
    memset(p, 0, four);
    volatile unsigned char c = p[four];
    free(p);
    return fz_set(r, FZ_LOAD, "read past a heap block: %u", c);
  }
  if (strcmp(what, "ubsan") == 0) {
    volatile int big = 2147483647;
    int v = big + 1;
    return fz_set(r, FZ_LOAD, "signed overflow: %d", v);
  }
  if (strcmp(what, "rss") == 0) {
    volatile size_t n = (size_t)300 << 20;
    char *volatile p = malloc(n);
    if (!p) return fz_set(r, FZ_CLEAN, "300 MiB refused");
    memset(p, 1, n);
    unsigned v = (unsigned char)p[n / 2];
    free(p);
    return fz_set(r, FZ_LOAD, "touched 300 MiB (%u)", v);
  }
  if (strcmp(what, "leak") == 0) {
    fz_leak_sink = malloc(100);
    fz_leak_sink = NULL;
    return fz_set(r, FZ_LOAD, "leaked 100 bytes");
  }
  return fz_set(r, FZ_LOAD, "%s", what);
}

/* ------------------------------------------------------------ driver */

typedef enum { T_SAFETENSORS, T_JSON, T_DATASET, T_SELFTEST } fz_target;

static fz_outcome fz_run(fz_target t, moe_ctx *ctx, const char *dir, fz_result *r) {
  moe_ctx_clear(ctx);
  switch (t) {
    case T_SAFETENSORS: return fz_safetensors(ctx, dir, r);
    case T_JSON: return fz_json(dir, r);
    case T_DATASET: return fz_dataset(ctx, dir, r);
    case T_SELFTEST: return fz_selftest(ctx, dir, r);
  }
  return fz_set(r, FZ_CRASH, "unknown target");
}

static void fz_limit_memory(void) {
#ifndef FZ_ASAN
  /* address space now (from /proc) + 1 GiB: a larger allocation fails */
  FILE *f = fopen("/proc/self/statm", "r");
  unsigned long pages = 0;
  if (f) {
    if (fscanf(f, "%lu", &pages) != 1) pages = 0;
    fclose(f);
  }
  if (pages) {
    struct rlimit rl;
    rl.rlim_cur = rl.rlim_max = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + FZ_MEM_LIMIT;
    setrlimit(RLIMIT_AS, &rl);
  }
#endif
}

/* The child: inputs [first, last] of DIR (or the one folder), each outcome
 * written to fd as "<i> <0|1|2> <detail>\n"; exit(0) so LeakSanitizer runs. */
static void fz_child(fz_target t, const char *dir, const char *one, long first, long last,
                     unsigned timeout_s, int fd) {
  char log[4200];
  if (!one) {
    snprintf(log, sizeof log, "%s/log.%ld", dir, first);
    int lf = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (lf >= 0) {
      dup2(lf, 2);
      close(lf);
    }
  }
  fz_limit_memory();
  moe_ctx *ctx = NULL;
  if (moe_ctx_init(&ctx) != MOE_OK) _exit(3);
  for (long i = first; i <= last; i++) {
    char in[4200];
    if (one) snprintf(in, sizeof in, "%s", one);
    else snprintf(in, sizeof in, "%s/%ld.", dir, i);
    fz_result r = {FZ_CRASH, ""};
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    alarm(timeout_s);
    fz_run(t, ctx, in, &r);
    alarm(0);
    getrusage(RUSAGE_SELF, &ru1);
    long grew_mb = (ru1.ru_maxrss - ru0.ru_maxrss) / 1024;
    if (grew_mb > FZ_RSS_GROWTH_MB && r.outcome != FZ_CRASH)
      fz_set(&r, FZ_CRASH, "peak memory grew by %ld MiB on a small input (%s)", grew_mb, r.detail);
    char line[512];
    int k = snprintf(line, sizeof line, "%ld %d %s\n", i, (int)r.outcome, r.detail);
    if (k >= (int)sizeof line) {
      k = (int)sizeof line - 1;
      line[k - 1] = '\n';
    }
    if (write(fd, line, (size_t)k) != k) _exit(4);
  }
  moe_ctx_free(ctx);
  close(fd);
  exit(0);
}

static const char *const outcome_names[] = {"clean", "load", "crash"};

/* Runs [first, last] in one child; returns how many outcomes it reported
 * (from first on) and the child's wait status in *status; the reported
 * lines go to *lines_out (the caller frees them with fz_free_lines). */
static long fz_batch(fz_target t, const char *dir, const char *one, long first, long last,
                     unsigned timeout_s, int *status, char ***lines_out) {
  int p[2];
  if (pipe(p) != 0) {
    perror("fuzz_core: pipe");
    exit(2);
  }
  fflush(stdout);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fuzz_core: fork");
    exit(2);
  }
  if (pid == 0) {
    close(p[0]);
    fz_child(t, dir, one, first, last, timeout_s, p[1]);
  }
  close(p[1]);
  FILE *in = fdopen(p[0], "r");
  long got = 0;
  char **lines = calloc((size_t)(last - first + 1), sizeof *lines);
  char *line = NULL;
  size_t cap = 0;
  while (got <= last - first && getline(&line, &cap, in) > 0) lines[got++] = strdup(line);
  free(line);
  fclose(in);
  while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
  }
  *lines_out = lines;
  return got;
}

static void fz_print_line(const char *line) {
  long i;
  int o;
  int off = 0;
  if (sscanf(line, "%ld %d %n", &i, &o, &off) < 2 || o < 0 || o > 2) {
    printf("%s", line);
    return;
  }
  printf("%ld %s %s", i, outcome_names[o], line + off);
}

static void fz_death(long i, int status, const char *dir, long log_of) {
  char why[128];
  if (WIFSIGNALED(status)) {
    int s = WTERMSIG(status);
    if (s == SIGALRM) {
      printf("%ld hang ran past the time limit\n", i);
      return;
    }
    snprintf(why, sizeof why, "killed by signal %d (%s)", s, strsignal(s));
  } else {
    snprintf(why, sizeof why, "exited with status %d (a sanitizer report?)",
             WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  }
  if (dir) printf("%ld crash %s; stderr in %s/log.%ld\n", i, why, dir, log_of);
  else printf("%ld crash %s\n", i, why);
}

static void fz_free_lines(char **lines, long n) {
  for (long k = 0; k < n; k++) free(lines[k]);
  free(lines);
}

/* Inputs [first, last] all reported, then the child exited non-zero (a
 * LeakSanitizer report at exit): each input again in a child of its own,
 * and a crash line for those whose child exits non-zero. The Lua side
 * takes a crash line over an earlier outcome of the same input. */
static void fz_find_exit_reports(fz_target t, const char *dir, long first, long last,
                                 unsigned timeout_s) {
  for (long k = first; k <= last; k++) {
    char **one = NULL;
    int st = 0;
    long g = fz_batch(t, dir, NULL, k, k, timeout_s, &st, &one);
    if (g == 1 && st != 0)
      printf("%ld crash a report at exit (a leak?); stderr in %s/log.%ld\n", k, dir, k);
    else if (g == 0)
      fz_death(k, st, dir, k);
    fz_free_lines(one, g);
  }
}

/* Runs [first, last] again, quietly, for the exit their child never had. */
static void fz_exit_check(fz_target t, const char *dir, long first, long last, unsigned timeout_s) {
  int st = 0;
  char **lines = NULL;
  long g = fz_batch(t, dir, NULL, first, last, timeout_s, &st, &lines);
  fz_free_lines(lines, g);
  if (g == last - first + 1 && st != 0) fz_find_exit_reports(t, dir, first, last, timeout_s);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--sanitized") == 0) {
#ifdef FZ_ASAN
    printf("1\n");
#else
    printf("0\n");
#endif
    return 0;
  }
  if (argc < 4) {
    fprintf(stderr, "usage: fuzz_core TARGET DIR FIRST LAST [TIMEOUT_S]\n"
                    "       fuzz_core TARGET --one PREFIX [TIMEOUT_S]\n"
                    "targets: safetensors, json, dataset, selftest\n");
    return 2;
  }
  fz_target t;
  if (strcmp(argv[1], "safetensors") == 0) t = T_SAFETENSORS;
  else if (strcmp(argv[1], "json") == 0) t = T_JSON;
  else if (strcmp(argv[1], "dataset") == 0) t = T_DATASET;
  else if (strcmp(argv[1], "selftest") == 0) t = T_SELFTEST;
  else {
    fprintf(stderr, "fuzz_core: unknown target '%s' (safetensors, json, dataset)\n", argv[1]);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (strcmp(argv[2], "--one") == 0) {
    unsigned timeout_s = argc > 4 ? (unsigned)atoi(argv[4]) : 10;
    int status = 0;
    char **lines = NULL;
    long got = fz_batch(t, NULL, argv[3], 0, 0, timeout_s, &status, &lines);
    if (got == 1) fz_print_line(lines[0]);
    if (got == 1 && status != 0) printf("0 crash the child exited with status %d after the input\n", status);
    if (got == 0) fz_death(0, status, NULL, 0);
    fz_free_lines(lines, got);
    return 0;
  }
  if (argc < 5) {
    fprintf(stderr, "fuzz_core: FIRST and LAST expected\n");
    return 2;
  }
  const char *dir = argv[2];
  long first = atol(argv[3]), last = atol(argv[4]);
  unsigned timeout_s = argc > 5 ? (unsigned)atoi(argv[5]) : 10;
  long i = first;
  while (i <= last) {
    long end = i + FZ_BATCH - 1 < last ? i + FZ_BATCH - 1 : last;
    int status = 0;
    char **lines = NULL;
    long got = fz_batch(t, dir, NULL, i, end, timeout_s, &status, &lines);
    for (long k = 0; k < got; k++) fz_print_line(lines[k]);
    fz_free_lines(lines, got);
    if (got == end - i + 1) {
      if (status != 0) fz_find_exit_reports(t, dir, i, end, timeout_s);
      i = end + 1;
    } else {
      fz_death(i + got, status, dir, i);
      /* the inputs before the death had no exit of their own: give them one */
      if (got > 0) fz_exit_check(t, dir, i, i + got - 1, timeout_s);
      i += got + 1;
    }
  }
  return 0;
}
