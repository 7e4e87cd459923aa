/* Strided copies between host buffers with non-temporal stores: kvtier's CPU gather of a hit's
 * blocks into a transformers cache and its DISK reads into one (kvtier.kernels.host_copy, which
 * compiles this file with the system's C compiler on first use and loads it with ctypes).
 *
 * Why: a hit moves tens to hundreds of MiB, far past the caches, in pieces of a few KiB (one
 * head's block_size x head_dim per row). Ordinary stores first read every destination line
 * into the cache (a read for ownership), then write it back: three memory passes per byte
 * moved. SSE2 streaming stores (MOVNTDQ) write whole lines straight to memory: two passes.
 * glibc's memcpy streams only copies larger than its non-temporal threshold (a fraction of
 * the L3 size), which pieces of 4 KiB never are (bench/results/2026-12-03-nt-gather).
 *
 * Every function trusts its pointers and sizes: the Python wrapper checks them first. */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVT_STREAMING 1
#else
#define KVT_STREAMING 0
#endif

static void copy_piece(char *dst, const char *src, int64_t n, int streaming) {
#if KVT_STREAMING
    if (streaming && n >= 64) {
        int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15); /* to a 16-byte boundary */
        memcpy(dst, src, (size_t)head);
        dst += head;
        src += head;
        n -= head;
        int64_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        for (; i + 16 <= n; i += 16)
            _mm_stream_si128((__m128i *)(dst + i), _mm_loadu_si128((const __m128i *)(src + i)));
        memcpy(dst + i, src + i, (size_t)(n - i));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n);
}

static void fence(int streaming) {
#if KVT_STREAMING
    if (streaming)
        _mm_sfence(); /* streaming stores are weakly ordered: visible to every thread after this */
#else
    (void)streaming;
#endif
}

/* rows x row_nbytes bytes: row r from src + r * src_stride to dst + r * dst_stride. */
void kvt_copy_rows(char *dst, int64_t dst_stride, const char *src, int64_t src_stride, int64_t rows,
                   int64_t row_nbytes, int streaming) {
    for (int64_t r = 0; r < rows; r++)
        copy_piece(dst + r * dst_stride, src + r * src_stride, row_nbytes, streaming);
    fence(streaming);
}

/* For each of num_blocks blocks: slot slots[b] of pool (rows pieces of piece_nbytes,
 * contiguous, slot_nbytes apart) to position positions[b] of out (piece p of row r at
 * out + r * out_row_stride + p * piece_nbytes). Blocks in order, each slot read in order. */
void kvt_gather_blocks(char *out, int64_t out_row_stride, const char *pool, int64_t slot_nbytes,
                       const int64_t *slots, const int64_t *positions, int64_t num_blocks, int64_t rows,
                       int64_t piece_nbytes, int streaming) {
    for (int64_t b = 0; b < num_blocks; b++) {
        const char *src = pool + slots[b] * slot_nbytes;
        char *dst = out + positions[b] * piece_nbytes;
        for (int64_t r = 0; r < rows; r++)
            copy_piece(dst + r * out_row_stride, src + r * piece_nbytes, piece_nbytes, streaming);
    }
    fence(streaming);
}

/* xxh3-64 while copying: a DISK record's payload verified and delivered in one pass over its
 * bytes, in one call that releases the GIL once. The hash functions are python-xxhash's own (the
 * library the Python side hashes records with), bound at load time by kvt_bind_xxh3. Through
 * python-xxhash each block took two GIL round trips (its hash releases the GIL only above
 * 64 KiB, then the copy), and with two I/O threads and the caller contending for it each
 * round trip can wait: hashing 64 KiB + 1 byte pieces on two threads costs 3x the CPU time of
 * one thread doing the same work (bench/results/2026-12-03-fused-hash/gil.log). */
typedef void *(*kvt_xxh3_create)(void);
typedef int (*kvt_xxh3_free)(void *);
typedef int (*kvt_xxh3_reset)(void *);
typedef int (*kvt_xxh3_update)(void *, const void *, size_t);
typedef uint64_t (*kvt_xxh3_digest)(const void *);

static kvt_xxh3_create xxh3_create;
static kvt_xxh3_free xxh3_free;
static kvt_xxh3_reset xxh3_reset;
static kvt_xxh3_update xxh3_update;
static kvt_xxh3_digest xxh3_digest;

/* XXH3_createState, XXH3_freeState, XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest
 * (xxhash.h's signatures). Called once, before any kvt_hash_copy_rows. */
void kvt_bind_xxh3(void *create, void *free_state, void *reset, void *update, void *digest) {
    xxh3_create = (kvt_xxh3_create)create;
    xxh3_free = (kvt_xxh3_free)free_state;
    xxh3_reset = (kvt_xxh3_reset)reset;
    xxh3_update = (kvt_xxh3_update)update;
    xxh3_digest = (kvt_xxh3_digest)digest;
}

static void hash_copy(void *state, char *dst, int64_t dst_stride, const char *src, int64_t rows, int64_t row_nbytes,
                      int64_t chunk_nbytes, int streaming) {
    if (row_nbytes >= chunk_nbytes) { /* long rows (a contiguous payload is one): each in chunks */
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t at = 0; at < row_nbytes; at += chunk_nbytes) {
                int64_t n = row_nbytes - at < chunk_nbytes ? row_nbytes - at : chunk_nbytes;
                xxh3_update(state, src + r * row_nbytes + at, (size_t)n);
                copy_piece(dst + r * dst_stride + at, src + r * row_nbytes + at, n, streaming);
            }
        }
    } else { /* short rows: as many whole rows a chunk as fit */
        int64_t per_chunk = row_nbytes > 0 ? chunk_nbytes / row_nbytes : rows + 1;
        for (int64_t r = 0; r < rows; r += per_chunk) {
            int64_t k = rows - r < per_chunk ? rows - r : per_chunk;
            xxh3_update(state, src + r * row_nbytes, (size_t)(k * row_nbytes));
            for (int64_t j = r; j < r + k; j++)
                copy_piece(dst + j * dst_stride, src + j * row_nbytes, row_nbytes, streaming);
        }
    }
}

/* *digest = xxh3-64 of prefix[0:prefix_nbytes] followed by rows x row_nbytes contiguous bytes
 * of src, copying row r to dst + r * dst_stride as it goes: each chunk of about chunk_nbytes
 * (whole rows) is hashed first, which brings it into cache, then copied from there. Returns
 * 0, or -1 (nothing written) when the hash is not bound, chunk_nbytes <= 0 or the hash's state cannot be
 * allocated. */
int kvt_hash_copy_rows(uint64_t *digest, const char *prefix, int64_t prefix_nbytes, char *dst, int64_t dst_stride,
                       const char *src, int64_t rows, int64_t row_nbytes, int64_t chunk_nbytes, int streaming) {
    if (!xxh3_create || chunk_nbytes <= 0)
        return -1;
    void *state = xxh3_create();
    if (!state)
        return -1;
    xxh3_reset(state);
    xxh3_update(state, prefix, (size_t)prefix_nbytes);
    hash_copy(state, dst, dst_stride, src, rows, row_nbytes, chunk_nbytes, streaming);
    fence(streaming);
    *digest = xxh3_digest(state);
    xxh3_free(state);
    return 0;
}

/* kvt_hash_copy_rows for num_blocks blocks of one layout in one call (one GIL release for a
 * whole DISK read job): block b's prefix at records[b], its payload at records[b] +
 * payload_offset, its rows to dsts[b] + r * dst_stride, its digest to digests[b]. */
int kvt_hash_copy_blocks(uint64_t *digests, const int64_t *records, int64_t prefix_nbytes, int64_t payload_offset,
                         const int64_t *dsts, int64_t dst_stride, int64_t num_blocks, int64_t rows, int64_t row_nbytes,
                         int64_t chunk_nbytes, int streaming) {
    if (!xxh3_create || chunk_nbytes <= 0)
        return -1;
    void *state = xxh3_create();
    if (!state)
        return -1;
    for (int64_t b = 0; b < num_blocks; b++) {
        const char *record = (const char *)(intptr_t)records[b];
        xxh3_reset(state);
        xxh3_update(state, record, (size_t)prefix_nbytes);
        hash_copy(state, (char *)(intptr_t)dsts[b], dst_stride, record + payload_offset, rows, row_nbytes, chunk_nbytes,
                  streaming);
        digests[b] = xxh3_digest(state);
    }
    fence(streaming);
    xxh3_free(state);
    return 0;
}
