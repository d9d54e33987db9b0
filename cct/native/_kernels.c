/* Compiled kernels for the steps whose numpy form is bound by many short passes over memory (see
 * cct/native/__init__.py): MAX and AVE pooling (forward and backward, 1 to 8 spatial axes), LRN across channels
 * with beta = 3/4 (forward and backward), the 2-D lowering of CcT's types 1 and 2 (im2col) and its adjoint
 * (col2im), ReLU's backward, BatchNorm's and Scale's passes over channel rows (each alone, and the two
 * forward as one), depthwise convolution (one input channel per group), Winograd's tile transforms, the SGD
 * solver's update step (and, at the end, a beta = 1 GEMM call into numpy's BLAS and a float32 GEMM of their own for
 * CPUs with AVX-512F or AVX2 and FMA).  Each kernel works on C-contiguous buffers (float32 or float64, chosen by
 * the buffer's item size), walks one channel plane (or image, or tile of channels, or value) at a time while it
 * sits in the core's cache, and releases the GIL, so the batch partitions' threads run it side by side.  Arguments
 * are checked before any memory is touched: a geometry that does not fit its buffers is a ValueError.
 *
 * MAX pooling (Caffe's scan): a window's maximum starts at -FLT_MAX and is replaced by each cell strictly
 * greater, kernel offsets in row-major order, so the winner is the first cell equal to the maximum and NaN
 * never wins.  The winner is kept as a one-byte code per window (0: none), which a table maps to the cell's
 * offset from the window's first cell; backward adds each window's gradient there, windows in order. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__)
/* one build, each machine's widest vectors: the loader picks the clone at run time */
#define CCT_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CCT_CLONES
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(_M_X64))
/* Kernels written with GCC's vector extension at a fixed width are built once per register width instead
 * (CCT_BY_WIDTH below): a vector wider than the target's registers is split for arithmetic but compared,
 * selected and shuffled lane by lane in scalar code (a 16-float max-pooling scan ran 2-4x slower than numpy on
 * an AVX2 machine). */
#define CCT_TARGET_512 __attribute__((target("avx512f")))
#define CCT_TARGET_256 __attribute__((target("avx2")))
static int widest_vector_bytes(void) {
    return __builtin_cpu_supports("avx512f") ? 64 : __builtin_cpu_supports("avx2") ? 32 : 16;
}
#else
#define CCT_TARGET_512
#define CCT_TARGET_256
static int widest_vector_bytes(void) { return 16; }
#endif
/* the width the CCT_BY_WIDTH kernels run at: the machine's widest, or a narrower one set by vector_width() */
static int vector_bytes_set = 0;
static int vector_bytes(void) {
    if (!vector_bytes_set) vector_bytes_set = widest_vector_bytes();
    return vector_bytes_set;
}

/* DEFINE(NAME##_512, T, BYTES = 64, TARGET), the same at 32 and 16 bytes, and NAME with the parameters ARGS(T)
 * calling the one of this machine's register width (vector_bytes()) with CALL, the arguments' names */
#define CCT_BY_WIDTH(DEFINE, NAME, T, ARGS, CALL)                                                           \
    DEFINE(NAME##_512, T, 64, CCT_TARGET_512)                                                                \
    DEFINE(NAME##_256, T, 32, CCT_TARGET_256)                                                                \
    DEFINE(NAME##_128, T, 16, )                                                                              \
    static void NAME ARGS(T) {                                                                               \
        const int bytes = vector_bytes();                                                                    \
        if (bytes == 64)                                                                                     \
            NAME##_512 CALL;                                                                                 \
        else if (bytes == 32)                                                                                \
            NAME##_256 CALL;                                                                                 \
        else                                                                                                 \
            NAME##_128 CALL;                                                                                 \
    }

/* short row copies as inline loops, not memcpy/memmove calls (GCC turns copy loops into library calls, which
 * cost more than the copy for the rows of a small plane) */
#if defined(__GNUC__) && !defined(__clang__)
#define CCT_INLINE_COPIES __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define CCT_INLINE_COPIES
#endif

#define POOL_MAX_AXES 8

typedef struct {
    Py_ssize_t planes, nd;  /* channel planes (N*C) and spatial axes (at least 2; 1-D pooling gives a row axis) */
    Py_ssize_t in[POOL_MAX_AXES], out[POOL_MAX_AXES], kernel[POOL_MAX_AXES], stride[POOL_MAX_AXES],
        pad[POOL_MAX_AXES], dilation[POOL_MAX_AXES];
    Py_ssize_t in_plane, out_plane, cells, rows, out_rows;  /* sizes; rows: all axes but the last */
} pool_geometry;

/* MAX pooling forward, one plane at a time.  The plane's rows (its cells along the last axis) are copied by
 * stride phase of the other axes into a padded buffer: padded row (u_0·s_0 + a_0, ...) is row (u_0, ...) of
 * phase (a_0, ...), each row sw·pe_w cells wide (sw, pe_w: the last axis's stride and phase extent); -inf
 * outside the image, which never beats -FLT_MAX.  With the wide grid of windows (out_0, pe_1, ..., pe_w) —
 * the first axis's outputs, then every later axis's phase extent — each kernel offset's cells for every window
 * lie at one fixed shift of one phase, sw apart: wide position q reads phase[t][sw·q + shift[t]].  Each offset
 * is then one long pass over the wide grid (positions past an axis's outputs read neighbouring cells and are
 * dropped), which vectorizes; the wide grid is cut to the output at the end. */
#define SCAN_BLOCK 16  /* the scan's widest vector lanes (float32 in 64 bytes): the wide grid is a multiple */

typedef struct {
    Py_ssize_t pe[POOL_MAX_AXES];        /* phase extent per axis */
    Py_ssize_t row_stride[POOL_MAX_AXES];  /* a phase block's stride per axis but the last */
    Py_ssize_t wide_stride[POOL_MAX_AXES]; /* the wide grid's stride per axis */
    Py_ssize_t phases, block, wide, k;   /* phase count, one phase's block, wide grid (whole vectors), offsets */
    Py_ssize_t *phase, *shift, *at;      /* per kernel offset (row-major): its phase, its shift in the phase's
                                          * block, and both as one place in the phase buffer */
    int dense;                           /* the wide grid is the output grid (pe_i = out_i past axis 0) */
    Py_ssize_t *row_at, *out_at;         /* per image row its place in the phase buffer; per output row its wide
                                          * position (worked out once per call: a plane's rows are then copies
                                          * with no integer division, which costs tens of cycles on some cores) */
} pool_scan;

/* Advance the multi-index idx over extents dims[0..n) (last fastest). */
static inline void next_index(Py_ssize_t *idx, const Py_ssize_t *dims, Py_ssize_t n) {
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        if (++idx[i] < dims[i]) return;
        idx[i] = 0;
    }
}

static int scan_setup(const pool_geometry *g, pool_scan *s) {
    const Py_ssize_t nd = g->nd, last = nd - 1;
    Py_ssize_t max_shift = 0;
    for (Py_ssize_t i = 0; i < nd; i++) {
        Py_ssize_t extent = (g->kernel[i] - 1) * g->dilation[i] + 1, padded = g->in[i] + 2 * g->pad[i];
        if ((g->out[i] - 1) * g->stride[i] + extent > padded) padded = (g->out[i] - 1) * g->stride[i] + extent;
        s->pe[i] = (padded + g->stride[i] - 1) / g->stride[i];
    }
    Py_ssize_t row = s->pe[last] * g->stride[last], block = row, wide = s->pe[last];
    s->phases = 1;
    s->row_stride[last] = 1;
    s->wide_stride[last] = 1;
    for (Py_ssize_t i = last - 1; i >= 0; i--) {
        s->row_stride[i] = block;
        s->wide_stride[i] = wide;
        block *= s->pe[i];
        wide *= i == 0 ? g->out[0] : s->pe[i];
        s->phases *= g->stride[i];
    }
    s->k = 1;
    for (Py_ssize_t i = 0; i < nd; i++) s->k *= g->kernel[i];
    s->wide = (wide + SCAN_BLOCK - 1) / SCAN_BLOCK * SCAN_BLOCK;
    s->phase = malloc((3 * s->k + g->rows + g->out_rows) * sizeof(Py_ssize_t));
    if (!s->phase) return -1;
    s->shift = s->phase + s->k;
    s->at = s->shift + s->k;
    s->row_at = s->at + s->k;
    s->out_at = s->row_at + g->rows;
    for (Py_ssize_t t = 0; t < s->k; t++) {
        Py_ssize_t rest = t, phase = 0, shift = 0, phase_mult = 1;
        for (Py_ssize_t i = last; i >= 0; i--) {  /* offset t's index along axis i, last axis fastest */
            Py_ssize_t c = (rest % g->kernel[i]) * g->dilation[i];
            rest /= g->kernel[i];
            if (i == last) {
                shift += c;
            } else {
                shift += (c / g->stride[i]) * s->row_stride[i];
                phase += (c % g->stride[i]) * phase_mult;
                phase_mult *= g->stride[i];
            }
        }
        s->phase[t] = phase;
        s->shift[t] = shift;
        if (shift > max_shift) max_shift = shift;
    }
    /* a phase's block: its rows plus room for the largest shift past the wide grid's last vector */
    s->block = block;
    if (g->stride[last] * (s->wide + SCAN_BLOCK) + max_shift > s->block)
        s->block = g->stride[last] * (s->wide + SCAN_BLOCK) + max_shift;
    for (Py_ssize_t t = 0; t < s->k; t++) s->at[t] = s->phase[t] * s->block + s->shift[t];
    Py_ssize_t idx[POOL_MAX_AXES] = {0};
    for (Py_ssize_t r = 0; r < g->rows; r++, next_index(idx, g->in, last)) {
        /* padded row (u_0·s_0 + a_0, ...) is row (u_0, ...) of phase (a_0, ...) */
        Py_ssize_t at = g->pad[last], phase = 0;
        for (Py_ssize_t i = 0; i < last; i++) {
            Py_ssize_t padded = idx[i] + g->pad[i];
            phase = phase * g->stride[i] + padded % g->stride[i];
            at += (padded / g->stride[i]) * s->row_stride[i];
        }
        s->row_at[r] = phase * s->block + at;
    }
    s->dense = 1;
    for (Py_ssize_t i = 1; i < nd; i++) s->dense &= s->pe[i] == g->out[i];
    memset(idx, 0, sizeof idx);
    for (Py_ssize_t r = 0; r < g->out_rows; r++, next_index(idx, g->out, last)) {
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < last; i++) at += idx[i] * s->wide_stride[i];
        s->out_at[r] = at;
    }
    return 0;
}

/* `bytes` (a multiple of 4) from `from` to `to`: rows under 64 bytes (a small plane's) as two fixed-size moves
 * that overlap in the middle, a loop (or one move) costing more than the copy there */
static inline void copy_row(void *restrict to, const void *restrict from, Py_ssize_t bytes) {
    char *d = to;
    const char *f = from;
    if (bytes >= 64) {
        memcpy(d, f, bytes);
    } else if (bytes >= 32) {
        memcpy(d, f, 32);
        memcpy(d + bytes - 32, f + bytes - 32, 32);
    } else if (bytes >= 16) {
        memcpy(d, f, 16);
        memcpy(d + bytes - 16, f + bytes - 16, 16);
    } else if (bytes >= 8) {
        memcpy(d, f, 8);
        memcpy(d + bytes - 8, f + bytes - 8, 8);
    } else if (bytes >= 4) {
        memcpy(d, f, 4);
    }
}

#define DEFINE_SPLIT(NAME, T)                                                                                \
    /* the image rows of one plane into the phase buffer (its border keeps -inf from the first fill) */     \
    CCT_CLONES static void NAME(const pool_geometry *g, const pool_scan *s, const T *restrict x,             \
                                T *restrict buf) {                                                           \
        const Py_ssize_t w = g->in[g->nd - 1];                                                               \
        for (Py_ssize_t r = 0; r < g->rows; r++) copy_row(buf + s->row_at[r], x + r * w, w * sizeof(T));  \
    }

/* One vector v of a kernel offset's cells for LANES wide positions from `cell`, sw apart (lo, hi: scratch; EVEN:
 * the vector's even-lanes shuffle) */
#define SCAN_LOAD(v, lo, hi, cell, sw, LANES, EVEN)                                                          \
    do {                                                                                                     \
        if ((sw) == 1) {                                                                                     \
            memcpy(&(v), (cell), sizeof(v));                                                                 \
        } else if (HAVE_SHUFFLEVECTOR && (sw) == 2) {                                                        \
            memcpy(&(lo), (cell), sizeof(lo));                                                               \
            memcpy(&(hi), (cell) + LANES, sizeof(hi));                                                       \
            (v) = EVEN(lo, hi);                                                                              \
        } else {                                                                                             \
            for (int l_ = 0; l_ < LANES; l_++) (v)[l_] = (cell)[(sw) * l_];                                  \
        }                                                                                                    \
    } while (0)

/* The scan SCAN_UNROLL vectors of wide positions at a time, their maxima and codes held in registers over the
 * kernel offsets (GCC/clang vector extensions, BYTES wide: built for each register width by CCT_BY_WIDTH).  Each
 * offset's compare and select waits on the previous offset's for the same vector; several independent vectors
 * keep the core busy meanwhile (every window still sees its offsets in order: the same maxima and codes).  The
 * wide grid is padded to whole vectors of the widest and each phase's block has room for the last vector's
 * reads. */
#define SCAN_UNROLL 4
/* one offset's cells (at `cell`, u vectors on) against the maximum bx and its code cdx */
#define SCAN_STEP(bx, cdx, u, EVEN)                                                                          \
    do {                                                                                                     \
        SCAN_LOAD(v, lo, hi, cell + sw * LANES * (u), sw, LANES, EVEN);                                      \
        gt = v > bx;                                                                                         \
        if (code) cdx = (cdx & ~gt) | ((ITYPE)codes[t] & gt);                                                \
        bx = (VEC)(((IVEC)bx & ~gt) | ((IVEC)v & gt));                                                       \
    } while (0)
#define SCAN_KEEP(bx, cdx, u)                                                                                \
    do {                                                                                                     \
        memcpy(best + q0 + LANES * (u), &bx, sizeof bx);                                                     \
        if (code)                                                                                            \
            for (int l = 0; l < LANES; l++) code[q0 + LANES * (u) + l] = (uint8_t)cdx[l];                    \
    } while (0)
#define DEFINE_SCAN(NAME, T, BYTES, TARGET)                                                                  \
    typedef T NAME##_vec __attribute__((vector_size(BYTES)));                                                \
    typedef SAME_SIZE_INT_##T NAME##_ivec __attribute__((vector_size(BYTES)));                               \
    /* best[q] = max over the offsets (and -FLT_MAX) and, with code, the winning offset's code (0: none) */  \
    TARGET static void NAME(const pool_geometry *g, const pool_scan *s, const T *buf, T *best, uint8_t *code, \
                            const uint8_t *codes) {                                                          \
        enum { LANES = BYTES / sizeof(T) };                                                                  \
        typedef NAME##_vec VEC;                                                                              \
        typedef NAME##_ivec IVEC;                                                                            \
        typedef SAME_SIZE_INT_##T ITYPE;                                                                     \
        const Py_ssize_t n = s->wide, sw = g->stride[g->nd - 1];                                             \
        VEC least, v = {0}, lo, hi;                                                                          \
        IVEC gt;                                                                                             \
        for (int l = 0; l < LANES; l++) least[l] = (T)-FLT_MAX;                                              \
        Py_ssize_t q0 = 0;                                                                                   \
        for (; q0 + SCAN_UNROLL * LANES <= n; q0 += SCAN_UNROLL * LANES) {                                   \
            VEC b0 = least, b1 = least, b2 = least, b3 = least;                                              \
            IVEC c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};                                                     \
            for (Py_ssize_t t = 0; t < s->k; t++) {                                                          \
                const T *cell = buf + s->at[t] + sw * q0;                                                    \
                SCAN_STEP(b0, c0, 0, EVEN_##T##_##BYTES);                                                    \
                SCAN_STEP(b1, c1, 1, EVEN_##T##_##BYTES);                                                    \
                SCAN_STEP(b2, c2, 2, EVEN_##T##_##BYTES);                                                    \
                SCAN_STEP(b3, c3, 3, EVEN_##T##_##BYTES);                                                    \
            }                                                                                                \
            SCAN_KEEP(b0, c0, 0);                                                                            \
            SCAN_KEEP(b1, c1, 1);                                                                            \
            SCAN_KEEP(b2, c2, 2);                                                                            \
            SCAN_KEEP(b3, c3, 3);                                                                            \
        }                                                                                                    \
        for (; q0 < n; q0 += LANES) {                                                                        \
            VEC b0 = least;                                                                                  \
            IVEC c0 = {0};                                                                                   \
            for (Py_ssize_t t = 0; t < s->k; t++) {                                                          \
                const T *cell = buf + s->at[t] + sw * q0;                                                    \
                SCAN_STEP(b0, c0, 0, EVEN_##T##_##BYTES);                                                    \
            }                                                                                                \
            SCAN_KEEP(b0, c0, 0);                                                                            \
        }                                                                                                    \
    }

typedef int32_t SAME_SIZE_INT_float;
typedef int64_t SAME_SIZE_INT_double;

/* the even lanes of (a, b) — EVEN_<T>_<BYTES>: a vector of T in BYTES — in one shuffle where the compiler has
 * __builtin_shufflevector (GCC 12, clang); without it stride 2 takes the scan's gather loop */
#if defined(__clang__) || __GNUC__ >= 12
#define HAVE_SHUFFLEVECTOR 1
#define EVEN_LANES_16(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define EVEN_LANES_8(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#define EVEN_LANES_4(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6)
#define EVEN_LANES_2(a, b) __builtin_shufflevector(a, b, 0, 2)
#else
#define HAVE_SHUFFLEVECTOR 0
#define EVEN_LANES_16(a, b) (a)
#define EVEN_LANES_8(a, b) (a)
#define EVEN_LANES_4(a, b) (a)
#define EVEN_LANES_2(a, b) (a)
#endif
#define EVEN_float_64 EVEN_LANES_16
#define EVEN_float_32 EVEN_LANES_8
#define EVEN_float_16 EVEN_LANES_4
#define EVEN_double_64 EVEN_LANES_8
#define EVEN_double_32 EVEN_LANES_4
#define EVEN_double_16 EVEN_LANES_2

DEFINE_SPLIT(split_f32, float)
DEFINE_SPLIT(split_f64, double)
#define SCAN_ARGS(T) (const pool_geometry *g, const pool_scan *s, const T *buf, T *best, uint8_t *code,      \
                      const uint8_t *codes)
CCT_BY_WIDTH(DEFINE_SCAN, scan_f32, float, SCAN_ARGS, (g, s, buf, best, code, codes))
CCT_BY_WIDTH(DEFINE_SCAN, scan_f64, double, SCAN_ARGS, (g, s, buf, best, code, codes))

#define DEFINE_CUT(NAME, T)                                                                                  \
    /* the wide grid cut to the output: maxima into ymax (and y), codes into win, row by row */              \
    CCT_CLONES CCT_INLINE_COPIES static void NAME(const pool_geometry *g, const pool_scan *s,                \
                                                  const T *restrict best, const uint8_t *restrict code,      \
                                                  T *restrict ymax, T *restrict y, uint8_t *restrict win) {  \
        const Py_ssize_t ow = s->dense ? g->out_plane : g->out[g->nd - 1], rows = s->dense ? 1 : g->out_rows; \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                              \
            const T *b = best + s->out_at[r];                                                                \
            const uint8_t *c = code + s->out_at[r];                                                          \
            for (Py_ssize_t k = 0; k < ow; k++) ymax[r * ow + k] = b[k];                                     \
            if (y)                                                                                           \
                for (Py_ssize_t k = 0; k < ow; k++) y[r * ow + k] = b[k];                                    \
            if (win)                                                                                         \
                for (Py_ssize_t k = 0; k < ow; k++) win[r * ow + k] = c[k];                                  \
        }                                                                                                    \
    }

DEFINE_CUT(cut_f32, float)
DEFINE_CUT(cut_f64, double)

#define DEFINE_MAX_FORWARD(NAME, SPLIT, SCAN, CUT, T)                                                        \
    static void NAME(const pool_geometry *g, const pool_scan *s, const T *x, T *ymax, T *y, uint8_t *win,    \
                     const uint8_t *codes, T *buf, T *best, uint8_t *code) {                                 \
        for (Py_ssize_t i = 0; i < s->phases * s->block; i++) buf[i] = (T)-INFINITY;                         \
        for (Py_ssize_t p = 0; p < g->planes; p++) {                                                         \
            const Py_ssize_t o = p * g->out_plane;                                                           \
            SPLIT(g, s, x + p * g->in_plane, buf);                                                           \
            SCAN(g, s, buf, best, win ? code : NULL, codes);                                                 \
            CUT(g, s, best, code, ymax + o, y ? y + o : NULL, win ? win + o : NULL);                         \
        }                                                                                                    \
    }

DEFINE_MAX_FORWARD(max_forward_f32, split_f32, scan_f32, cut_f32, float)
DEFINE_MAX_FORWARD(max_forward_f64, split_f64, scan_f64, cut_f64, double)

/* dx[plane, start(o) + delta[code[o]]] += dy[o] (times ymax[o] > 0 with positive), windows in order;
 * start(o): the window's first (possibly padded) cell, Σ (o_i·s_i - p_i)·(input stride of axis i). */
#define DEFINE_MAX_BACKWARD(NAME, T)                                                                         \
    static void NAME(const pool_geometry *g, const T *dy, const T *ymax, const uint8_t *win,                 \
                     const int64_t *delta, T *dx, int accumulate, int positive) {                            \
        const Py_ssize_t last = g->nd - 1, ow = g->out[last], sw = g->stride[last];                          \
        Py_ssize_t in_stride[POOL_MAX_AXES];                                                                 \
        in_stride[last] = 1;                                                                                 \
        for (Py_ssize_t i = last - 1; i >= 0; i--) in_stride[i] = in_stride[i + 1] * g->in[i + 1];           \
        for (Py_ssize_t p = 0; p < g->planes; p++) {                                                         \
            T *d = dx + p * g->in_plane;                                                                     \
            if (!accumulate) memset(d, 0, g->in_plane * sizeof(T));                                          \
            Py_ssize_t idx[POOL_MAX_AXES] = {0};                                                             \
            for (Py_ssize_t r = 0; r < g->out_rows; r++, next_index(idx, g->out, last)) {                    \
                Py_ssize_t at = p * g->out_plane + r * ow, start = -g->pad[last];                            \
                for (Py_ssize_t i = 0; i < last; i++) start += (idx[i] * g->stride[i] - g->pad[i]) * in_stride[i]; \
                for (Py_ssize_t k = 0; k < ow; k++) {                                                        \
                    uint8_t c = win[at + k];                                                                 \
                    if (!c) continue;                                                                        \
                    T v = dy[at + k];                                                                        \
                    if (positive) v = v * (T)(ymax[at + k] > 0);                                             \
                    Py_ssize_t cell = start + k * sw + delta[c];                                             \
                    if (cell >= 0 && cell < g->in_plane) d[cell] += v;                                       \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_MAX_BACKWARD(max_backward_f32, float)
DEFINE_MAX_BACKWARD(max_backward_f64, double)

/* one offset's cells (at `cell`, u vectors on) added to the sum bx */
#define SUM_STEP(bx, u, EVEN)                                                                                \
    do {                                                                                                     \
        SCAN_LOAD(v, lo, hi, cell + sw * LANES * (u), sw, LANES, EVEN);                                      \
        bx += v;                                                                                             \
    } while (0)
/* AVE pooling forward: MAX's phase buffer (zero outside the image: padding adds nothing) and wide grid; each
 * window's sum starts at the first kernel offset's cell and adds the others in row-major order (the numpy body's
 * additions), then is divided by the window's size (Caffe's divisor, padded cells counted: `size`, one plane's
 * outputs).  Planes grouped by group_planes() cover `size` once per plane of the group.  SCAN_UNROLL independent
 * sums at a time (see DEFINE_SCAN). */
#define DEFINE_SUM_SCAN(NAME, T, BYTES, TARGET)                                                              \
    typedef T NAME##_vec __attribute__((vector_size(BYTES)));                                                \
    TARGET static void NAME(const pool_geometry *g, const pool_scan *s, const T *buf, T *sum) {              \
        enum { LANES = BYTES / sizeof(T) };                                                                  \
        const Py_ssize_t n = s->wide, sw = g->stride[g->nd - 1];                                             \
        NAME##_vec v = {0}, lo, hi;                                                                          \
        Py_ssize_t q0 = 0;                                                                                   \
        for (; q0 + SCAN_UNROLL * LANES <= n; q0 += SCAN_UNROLL * LANES) {                                   \
            NAME##_vec b0, b1, b2, b3;                                                                       \
            const T *cell = buf + s->at[0] + sw * q0;                                                        \
            SCAN_LOAD(b0, lo, hi, cell, sw, LANES, EVEN_##T##_##BYTES);                                      \
            SCAN_LOAD(b1, lo, hi, cell + sw * LANES, sw, LANES, EVEN_##T##_##BYTES);                         \
            SCAN_LOAD(b2, lo, hi, cell + sw * LANES * 2, sw, LANES, EVEN_##T##_##BYTES);                     \
            SCAN_LOAD(b3, lo, hi, cell + sw * LANES * 3, sw, LANES, EVEN_##T##_##BYTES);                     \
            for (Py_ssize_t t = 1; t < s->k; t++) {                                                          \
                cell = buf + s->at[t] + sw * q0;                                                             \
                SUM_STEP(b0, 0, EVEN_##T##_##BYTES);                                                         \
                SUM_STEP(b1, 1, EVEN_##T##_##BYTES);                                                         \
                SUM_STEP(b2, 2, EVEN_##T##_##BYTES);                                                         \
                SUM_STEP(b3, 3, EVEN_##T##_##BYTES);                                                         \
            }                                                                                                \
            memcpy(sum + q0, &b0, sizeof b0);                                                                \
            memcpy(sum + q0 + LANES, &b1, sizeof b1);                                                        \
            memcpy(sum + q0 + LANES * 2, &b2, sizeof b2);                                                    \
            memcpy(sum + q0 + LANES * 3, &b3, sizeof b3);                                                    \
        }                                                                                                    \
        for (; q0 < n; q0 += LANES) {                                                                        \
            NAME##_vec b0;                                                                                   \
            const T *cell = buf + s->at[0] + sw * q0;                                                        \
            SCAN_LOAD(b0, lo, hi, cell, sw, LANES, EVEN_##T##_##BYTES);                                      \
            for (Py_ssize_t t = 1; t < s->k; t++) {                                                          \
                cell = buf + s->at[t] + sw * q0;                                                             \
                SUM_STEP(b0, 0, EVEN_##T##_##BYTES);                                                         \
            }                                                                                                \
            memcpy(sum + q0, &b0, sizeof b0);                                                                \
        }                                                                                                    \
    }

#define SUM_SCAN_ARGS(T) (const pool_geometry *g, const pool_scan *s, const T *buf, T *sum)
CCT_BY_WIDTH(DEFINE_SUM_SCAN, sum_scan_f32, float, SUM_SCAN_ARGS, (g, s, buf, sum))
CCT_BY_WIDTH(DEFINE_SUM_SCAN, sum_scan_f64, double, SUM_SCAN_ARGS, (g, s, buf, sum))

#define DEFINE_AVE_FORWARD(NAME, SPLIT, SUM, T)                                                              \
    /* size_rows: the output rows of one ungrouped plane (`size` has size_rows * ow values) */               \
    static void NAME(const pool_geometry *g, const pool_scan *s, const T *x, T *y, const T *size,          \
                     Py_ssize_t size_rows, T *buf, T *sum) {                                                 \
        const Py_ssize_t ow = g->out[g->nd - 1];                                                             \
        memset(buf, 0, s->phases * s->block * sizeof(T));                                                   \
        for (Py_ssize_t p = 0; p < g->planes; p++) {                                                         \
            T *out = y + p * g->out_plane;                                                                   \
            SPLIT(g, s, x + p * g->in_plane, buf);                                                           \
            SUM(g, s, buf, sum);                                                                             \
            for (Py_ssize_t r = 0, sr = 0; r < g->out_rows; r++, sr = sr + 1 == size_rows ? 0 : sr + 1) {    \
                const T *restrict b = sum + s->out_at[r], *restrict d = size + sr * ow;                     \
                T *restrict to = out + r * ow;                                                               \
                for (Py_ssize_t k = 0; k < ow; k++) to[k] = b[k] / d[k];                                     \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_AVE_FORWARD(ave_forward_f32, split_f32, sum_scan_f32, float)
DEFINE_AVE_FORWARD(ave_forward_f64, split_f64, sum_scan_f64, double)

/* One window per plane inside it (global pooling): the scan's wide grid would hold every cell of the plane for one
 * output; instead AVE_LANES planes at a time, each window's cells (in-plane offsets `cell`, row-major) added in
 * turn to that plane's sum — the same additions in the same order. */
#define AVE_LANES 16
#define DEFINE_AVE_WHOLE(NAME, T)                                                                            \
    CCT_CLONES static void NAME(const pool_geometry *g, const Py_ssize_t *cell, const T *x, T *y, T size) {  \
        for (Py_ssize_t p0 = 0; p0 < g->planes; p0 += AVE_LANES) {                                           \
            const Py_ssize_t m = g->planes - p0 < AVE_LANES ? g->planes - p0 : AVE_LANES;                    \
            const T *src = x + p0 * g->in_plane;                                                             \
            T acc[AVE_LANES];                                                                                \
            for (Py_ssize_t l = 0; l < m; l++) acc[l] = src[l * g->in_plane + cell[0]];                      \
            for (Py_ssize_t t = 1; t < g->cells; t++)                                                        \
                for (Py_ssize_t l = 0; l < m; l++) acc[l] += src[l * g->in_plane + cell[t]];                 \
            for (Py_ssize_t l = 0; l < m; l++) y[p0 + l] = acc[l] / size;                                    \
        }                                                                                                    \
    }

DEFINE_AVE_WHOLE(ave_whole_f32, float)
DEFINE_AVE_WHOLE(ave_whole_f64, double)

/* AVE pooling backward, one plane at a time: each window's gradient dy·inv (inv: 1/size, 0 for a window without
 * image cells) added into a zeroed padded plane at every kernel offset's cell — offsets in row-major order, the
 * windows in order within each, as the numpy body adds them — then the plane's image cells into dx (added with
 * accumulate).  The plane: per axis the padded extent and any overhang of the last window. */
typedef struct {
    Py_ssize_t cells;                     /* the padded plane's */
    Py_ssize_t *delta, *row_start, *in_at; /* per kernel offset, output row and input row: its padded position */
} ave_plan;

static int ave_plan_setup(const pool_geometry *g, ave_plan *a) {
    const Py_ssize_t nd = g->nd, last = nd - 1;
    Py_ssize_t extent[POOL_MAX_AXES], stride[POOL_MAX_AXES];
    for (Py_ssize_t i = 0; i < nd; i++) {
        extent[i] = g->in[i] + 2 * g->pad[i];
        Py_ssize_t reach = (g->out[i] - 1) * g->stride[i] + (g->kernel[i] - 1) * g->dilation[i] + 1;
        if (reach > extent[i]) extent[i] = reach;
    }
    stride[last] = 1;
    for (Py_ssize_t i = last - 1; i >= 0; i--) stride[i] = stride[i + 1] * extent[i + 1];
    a->cells = stride[0] * extent[0];
    a->delta = malloc((g->cells + g->out_rows + g->rows) * sizeof(Py_ssize_t));
    if (!a->delta) return -1;
    a->row_start = a->delta + g->cells;
    a->in_at = a->row_start + g->out_rows;
    for (Py_ssize_t t = 0; t < g->cells; t++) {
        Py_ssize_t rest = t, at = 0;
        for (Py_ssize_t i = last; i >= 0; i--) {
            at += (rest % g->kernel[i]) * g->dilation[i] * stride[i];
            rest /= g->kernel[i];
        }
        a->delta[t] = at;
    }
    Py_ssize_t idx[POOL_MAX_AXES] = {0};
    for (Py_ssize_t r = 0; r < g->out_rows; r++, next_index(idx, g->out, last)) {
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < last; i++) at += idx[i] * g->stride[i] * stride[i];
        a->row_start[r] = at;
    }
    memset(idx, 0, sizeof idx);
    for (Py_ssize_t r = 0; r < g->rows; r++, next_index(idx, g->in, last)) {
        Py_ssize_t at = g->pad[last];
        for (Py_ssize_t i = 0; i < last; i++) at += (idx[i] + g->pad[i]) * stride[i];
        a->in_at[r] = at;
    }
    return 0;
}

#define DEFINE_AVE_BACKWARD(NAME, T)                                                                         \
    CCT_CLONES static void NAME(const pool_geometry *g, const ave_plan *a, const T *dy, const T *inv, T *dx, \
                                int accumulate, T *plane, T *grad) {                                         \
        const Py_ssize_t last = g->nd - 1, ow = g->out[last], sw = g->stride[last], w = g->in[last];         \
        for (Py_ssize_t p = 0; p < g->planes; p++) {                                                         \
            const T *restrict gy = dy + p * g->out_plane;                                                    \
            T *restrict d = dx + p * g->in_plane;                                                            \
            for (Py_ssize_t k = 0; k < g->out_plane; k++) grad[k] = gy[k] * inv[k];                          \
            memset(plane, 0, a->cells * sizeof(T));                                                          \
            for (Py_ssize_t t = 0; t < g->cells; t++)                                                        \
                for (Py_ssize_t r = 0; r < g->out_rows; r++) {                                               \
                    T *restrict to = plane + a->row_start[r] + a->delta[t];                                  \
                    const T *restrict from = grad + r * ow;                                                  \
                    if (sw == 1)                                                                             \
                        for (Py_ssize_t k = 0; k < ow; k++) to[k] += from[k];                                \
                    else                                                                                     \
                        for (Py_ssize_t k = 0; k < ow; k++) to[k * sw] += from[k];                           \
                }                                                                                            \
            for (Py_ssize_t r = 0; r < g->rows; r++) {                                                       \
                const T *restrict from = plane + a->in_at[r];                                                \
                T *restrict to = d + r * w;                                                                  \
                if (accumulate)                                                                              \
                    for (Py_ssize_t k = 0; k < w; k++) to[k] += from[k];                                     \
                else                                                                                         \
                    for (Py_ssize_t k = 0; k < w; k++) to[k] = from[k];                                      \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_AVE_BACKWARD(ave_backward_f32, float)
DEFINE_AVE_BACKWARD(ave_backward_f64, double)

/* ... and with one window per plane inside it (global pooling): its cells (in-plane offsets `cell`, each once) get
 * 0 + dy·inv, the others 0 (as the padded plane's sums: -0.0 becomes +0.0) */
#define DEFINE_AVE_WHOLE_BACKWARD(NAME, T)                                                                   \
    CCT_CLONES static void NAME(const pool_geometry *g, const Py_ssize_t *cell, const T *dy, T inv, T *dx,   \
                                int accumulate) {                                                            \
        for (Py_ssize_t p = 0; p < g->planes; p++) {                                                         \
            T *restrict d = dx + p * g->in_plane;                                                            \
            const T v = (T)0 + dy[p] * inv;                                                                  \
            if (accumulate) {                                                                                \
                for (Py_ssize_t t = 0; t < g->cells; t++) d[cell[t]] += v;                                   \
            } else {                                                                                         \
                if (g->cells < g->in_plane) memset(d, 0, g->in_plane * sizeof(T));                           \
                for (Py_ssize_t t = 0; t < g->cells; t++) d[cell[t]] = v;                                    \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_AVE_WHOLE_BACKWARD(ave_whole_backward_f32, float)
DEFINE_AVE_WHOLE_BACKWARD(ave_whole_backward_f64, double)

/* Whether every plane has one window, inside it (no padding, the kernel within the image), and then its cells'
 * in-plane offsets, row-major (NULL otherwise, or on an error with a Python exception set). */
static Py_ssize_t *whole_plane_cells(const pool_geometry *g, int *whole) {
    *whole = g->out_plane == 1;
    for (Py_ssize_t i = 0; i < g->nd; i++) *whole &= g->pad[i] == 0 && (g->kernel[i] - 1) * g->dilation[i] < g->in[i];
    if (!*whole) return NULL;
    Py_ssize_t *cell = malloc(g->cells * sizeof(Py_ssize_t)), idx[POOL_MAX_AXES] = {0};
    if (!cell) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t t = 0; t < g->cells; t++, next_index(idx, g->kernel, g->nd)) {
        Py_ssize_t at = 0;
        for (Py_ssize_t i = 0; i < g->nd; i++) at = at * g->in[i] + idx[i] * g->dilation[i];
        cell[t] = at;
    }
    return cell;
}


/* Lowering (im2col, CcT's type 1) of 2-D images: col[c][i][j][img][r][k] = x_pad[img][c][r·sh + i·dh][k·sw + j·dw]
 * (zero in the padding).  Each image is first split by stride phase into a zero-bordered buffer (padded cell
 * (u·sh + a, v·sw + b) at phase (a, b), position (u, v)), so every output row of every kernel offset is one
 * contiguous run of a phase row: ow cells copied at a time instead of gathered sw apart. */
#define DEFINE_IM2COL(NAME, T)                                                                               \
    /* the divisions once per call (tens of cycles each on some cores): per image row its phase row, per     \
     * column phase b its first and last position, per kernel offset its run's start in a channel */         \
    static void NAME##_tables(Py_ssize_t h, Py_ssize_t w, const Py_ssize_t *k, Py_ssize_t pe_h,              \
                              Py_ssize_t pe_w, Py_ssize_t *table) {                                          \
        const Py_ssize_t kh = k[0], kw = k[1], sh = k[2], sw = k[3], ph = k[4], pw = k[5], dh = k[6], dw = k[7]; \
        const Py_ssize_t phase = pe_h * pe_w;                                                                \
        Py_ssize_t *row_at = table, *v0 = table + h, *v1 = v0 + sw, *offset = v1 + sw;                       \
        for (Py_ssize_t row = 0; row < h; row++)                                                             \
            row_at[row] = ((row + ph) % sh) * sw * phase + ((row + ph) / sh) * pe_w;                         \
        for (Py_ssize_t b = 0; b < sw; b++) {  /* padded column v·sw + b: image column v·sw + b - pw */     \
            v0[b] = pw - b > 0 ? (pw - b + sw - 1) / sw : 0;                                                 \
            v1[b] = w - 1 + pw - b < 0 ? -1 : (w - 1 + pw - b) / sw; /* -1: no image column in this phase */ \
        }                                                                                                    \
        for (Py_ssize_t i = 0; i < kh; i++)                                                                  \
            for (Py_ssize_t j = 0; j < kw; j++) {                                                            \
                const Py_ssize_t ci = i * dh, cj = j * dw;                                                   \
                offset[i * kw + j] = ((ci % sh) * sw + cj % sw) * phase + (ci / sh) * pe_w + cj / sw;        \
            }                                                                                                \
    }                                                                                                        \
    /* image img's channels split by stride phase into buf (zeroed once per call: the cells written are the   \
     * same for every image) */                                                                              \
    static void NAME##_split(const T *x, Py_ssize_t img, Py_ssize_t c, Py_ssize_t h, Py_ssize_t w,          \
                             const Py_ssize_t *k, T *buf, Py_ssize_t phase, const Py_ssize_t *table) {       \
        const Py_ssize_t sh = k[2], sw = k[3], pw = k[5], chan = sh * sw * phase;                            \
        const Py_ssize_t *row_at = table, *v0 = table + h, *v1 = v0 + sw;                                    \
        for (Py_ssize_t ch = 0; ch < c; ch++)                                                                \
            for (Py_ssize_t row = 0; row < h; row++) {                                                       \
                const T *src = x + ((img * c + ch) * h + row) * w;                                           \
                T *base = buf + ch * chan + row_at[row];                                                     \
                for (Py_ssize_t b = 0; b < sw; b++) {                                                        \
                    const T *restrict from = src + b - pw;                                                   \
                    T *restrict to = base + b * phase;                                                       \
                    for (Py_ssize_t v = v0[b]; v <= v1[b]; v++) to[v] = from[v * sw];                        \
                }                                                                                            \
            }                                                                                                \
    }                                                                                                        \
    static void NAME(const T *x, T *col, Py_ssize_t n, Py_ssize_t c, Py_ssize_t h, Py_ssize_t w,            \
                     const Py_ssize_t *k, T *buf, Py_ssize_t pe_h, Py_ssize_t pe_w, Py_ssize_t *table) {     \
        const Py_ssize_t kh = k[0], kw = k[1], sh = k[2], sw = k[3];                                         \
        const Py_ssize_t oh = k[8], ow = k[9], phase = pe_h * pe_w, chan = sh * sw * phase;                  \
        const Py_ssize_t *offset = table + h + 2 * sw;                                                       \
        NAME##_tables(h, w, k, pe_h, pe_w, table);                                                           \
        memset(buf, 0, c * chan * sizeof(T));                                                                \
        for (Py_ssize_t img = 0; img < n; img++) {                                                           \
            NAME##_split(x, img, c, h, w, k, buf, phase, table);                                             \
            for (Py_ssize_t ch = 0; ch < c; ch++)                                                            \
                for (Py_ssize_t t = 0; t < kh * kw; t++) {                                                   \
                    const T *src = buf + ch * chan + offset[t];                                              \
                    T *dst = col + ((ch * kh * kw + t) * n + img) * oh * ow;                                 \
                    for (Py_ssize_t r = 0; r < oh; r++) memcpy(dst + r * ow, src + r * pe_w, ow * sizeof(T)); \
                }                                                                                            \
        }                                                                                                    \
    }

DEFINE_IM2COL(im2col_f32, float)
DEFINE_IM2COL(im2col_f64, double)

/* Its adjoint (col2im), for either layout: dx[img][c] = Σ of every col entry into the padded cell it was read
 * from, the kernel offsets in row-major order (as the numpy bodies add them: the same sums in the same order), one
 * channel at a time in a zeroed padded plane whose image cells are then moved into dx.  `last`: col (c, kh, kw, oh,
 * ow, n), the plane's cells holding every image (a stride-1 row is one run of ow·n values); else col (c, kh, kw,
 * n, oh, ow), one image's plane at a time. */
#define DEFINE_COL2IM(NAME, T)                                                                               \
    static void NAME(const T *col, T *dx, Py_ssize_t n, Py_ssize_t c, Py_ssize_t h, Py_ssize_t w,           \
                     const Py_ssize_t *k, T *plane, Py_ssize_t hp, Py_ssize_t wp, int last) {                \
        const Py_ssize_t kh = k[0], kw = k[1], sh = k[2], sw = k[3], ph = k[4], pw = k[5], dh = k[6], dw = k[7]; \
        const Py_ssize_t oh = k[8], ow = k[9];                                                               \
        /* images per plane cell, planes per channel, and the col offset of the next plane's rows */         \
        const Py_ssize_t m = last ? n : 1, planes = last ? 1 : n, step = last ? 0 : oh * ow;                 \
        for (Py_ssize_t img = 0; img < planes; img++)                                                        \
            for (Py_ssize_t ch = 0; ch < c; ch++) {                                                          \
                memset(plane, 0, hp * wp * m * sizeof(T));                                                   \
                for (Py_ssize_t i = 0; i < kh; i++)                                                          \
                    for (Py_ssize_t j = 0; j < kw; j++) {                                                    \
                        const T *src = col + ((ch * kh + i) * kw + j) * n * oh * ow + img * step;            \
                        for (Py_ssize_t r = 0; r < oh; r++) {                                                \
                            T *restrict to = plane + ((r * sh + i * dh) * wp + j * dw) * m;                  \
                            const T *restrict from = src + r * ow * m;                                       \
                            if (sw == 1)                                                                     \
                                for (Py_ssize_t v = 0; v < ow * m; v++) to[v] += from[v];                    \
                            else                                                                             \
                                for (Py_ssize_t q = 0; q < ow; q++)                                          \
                                    for (Py_ssize_t v = 0; v < m; v++) to[q * sw * m + v] += from[q * m + v]; \
                        }                                                                                    \
                    }                                                                                        \
                for (Py_ssize_t v = 0; v < m; v++) {                                                         \
                    T *out = dx + ((img + v) * c + ch) * h * w;                                              \
                    for (Py_ssize_t row = 0; row < h; row++) {                                               \
                        const T *restrict from = plane + ((row + ph) * wp + pw) * m + v;                     \
                        T *restrict to = out + row * w;                                                      \
                        for (Py_ssize_t q = 0; q < w; q++) to[q] = from[q * m];                              \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
    }

DEFINE_COL2IM(col2im_f32, float)
DEFINE_COL2IM(col2im_f64, double)

/* The same lowering with the images innermost (the numpy body's layout for small outputs): col (c, kh, kw, oh, ow,
 * n). One channel at a time, the image moved into a zero-padded plane of (row, column, image) cells; each kernel
 * offset's output cell then reads a run of n values. */
#define DEFINE_IM2COL_LAST(NAME, T)                                                                          \
    CCT_INLINE_COPIES static void NAME(const T *x, T *col, Py_ssize_t n, Py_ssize_t c, Py_ssize_t h,         \
                                       Py_ssize_t w, const Py_ssize_t *k, T *plane, Py_ssize_t hp, Py_ssize_t wp) {\
        const Py_ssize_t kh = k[0], kw = k[1], sh = k[2], sw = k[3], ph = k[4], pw = k[5], dh = k[6], dw = k[7]; \
        const Py_ssize_t oh = k[8], ow = k[9];                                                               \
        memset(plane, 0, hp * wp * n * sizeof(T));                                                           \
        for (Py_ssize_t ch = 0; ch < c; ch++) {                                                              \
            for (Py_ssize_t img = 0; img < n; img++) {                                                       \
                const T *src = x + (img * c + ch) * h * w;                                                   \
                for (Py_ssize_t row = 0; row < h; row++) {                                                   \
                    T *restrict to = plane + ((row + ph) * wp + pw) * n + img;                               \
                    const T *restrict from = src + row * w;                                                  \
                    for (Py_ssize_t q = 0; q < w; q++) to[q * n] = from[q];                                  \
                }                                                                                            \
            }                                                                                                \
            T *dst = col + ch * kh * kw * oh * ow * n;                                                       \
            for (Py_ssize_t i = 0; i < kh; i++)                                                              \
                for (Py_ssize_t j = 0; j < kw; j++)                                                          \
                    for (Py_ssize_t r = 0; r < oh; r++, dst += ow * n) {                                     \
                        const T *src = plane + ((r * sh + i * dh) * wp + j * dw) * n;                        \
                        if (sw == 1) /* the row's cells follow each other: one run of ow·n values */         \
                            memcpy(dst, src, ow * n * sizeof(T));                                            \
                        else /* n values a cell: a loop, not a library call per cell (4 bytes at one image) */ \
                            for (Py_ssize_t q = 0; q < ow; q++)                                              \
                                for (Py_ssize_t v = 0; v < n; v++) dst[q * n + v] = src[q * sw * n + v];     \
                    }                                                                                        \
        }                                                                                                    \
    }

DEFINE_IM2COL_LAST(im2col_last_f32, float)
DEFINE_IM2COL_LAST(im2col_last_f64, double)

/* LRN across channels with beta = 3/4 (Caffe's default and CaffeNet's), the numpy body's passes fused and
 * in its order, so the results are the same bits:
 *   scale[c] = k + Σ_{d<=r} (coeff·x²)[c±d]  (centre first, then for d = 1..r the neighbour below and above),
 *   factor = scale^(-3/4) = 1 / (√scale · √√scale),  y = x · factor;
 *   dx = dy · factor + (Σ_{d<=r} (dy · y / scale)[c±d]) · x · gain,  gain = -2·coeff·beta.
 * One image at a time, in tiles of LRN_TILE positions of every channel plane, whose squares and ratios stay
 * in the cache between the window's passes.  Forward keeps the scale (Caffe's scale_: backward uses it with
 * the bottom as it is then); the factor is computed again from it in backward instead of kept. */
#define LRN_TILE 64

#define DEFINE_LRN(FWD, BWD, T)                                                                              \
    CCT_CLONES static void FWD(const T *x, T *scale, T *y, Py_ssize_t n, Py_ssize_t c, Py_ssize_t hw,       \
                               Py_ssize_t size, T k, T coeff, T *sq) {                                       \
        const Py_ssize_t r = (size - 1) / 2;                                                                 \
        for (Py_ssize_t img = 0; img < n; img++)                                                             \
            for (Py_ssize_t p0 = 0; p0 < hw; p0 += LRN_TILE) {                                               \
                const Py_ssize_t m = hw - p0 < LRN_TILE ? hw - p0 : LRN_TILE, at0 = img * c * hw + p0;      \
                for (Py_ssize_t ch = 0; ch < c; ch++) {                                                      \
                    const T *restrict xs = x + at0 + ch * hw;                                                \
                    T *restrict q = sq + ch * LRN_TILE;                                                      \
                    for (Py_ssize_t i = 0; i < m; i++) q[i] = xs[i] * xs[i] * coeff;                         \
                }                                                                                            \
                for (Py_ssize_t ch = 0; ch < c; ch++) {                                                      \
                    const Py_ssize_t at = at0 + ch * hw;                                                     \
                    T *restrict s = scale + at, *restrict out = y + at;                                      \
                    const T *restrict xs = x + at, *restrict q = sq + ch * LRN_TILE;                         \
                    for (Py_ssize_t i = 0; i < m; i++) s[i] = q[i] + k;                                      \
                    for (Py_ssize_t d = 1; d <= r; d++) {                                                    \
                        if (ch - d >= 0) {                                                                   \
                            const T *restrict lo = sq + (ch - d) * LRN_TILE;                                 \
                            for (Py_ssize_t i = 0; i < m; i++) s[i] += lo[i];                                \
                        }                                                                                    \
                        if (ch + d < c) {                                                                    \
                            const T *restrict hi = sq + (ch + d) * LRN_TILE;                                 \
                            for (Py_ssize_t i = 0; i < m; i++) s[i] += hi[i];                                \
                        }                                                                                    \
                    }                                                                                        \
                    for (Py_ssize_t i = 0; i < m; i++) {                                                     \
                        T root = SQRT_##T(s[i]);                                                             \
                        out[i] = xs[i] * ((T)1 / (root * SQRT_##T(root)));                                   \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
    }                                                                                                        \
    CCT_CLONES static void BWD(const T *x, const T *y, const T *dy, const T *scale, T *dx, Py_ssize_t n,    \
                               Py_ssize_t c, Py_ssize_t hw, Py_ssize_t size, T gain, T *ratio) {             \
        const Py_ssize_t r = (size - 1) / 2;                                                                 \
        for (Py_ssize_t img = 0; img < n; img++)                                                             \
            for (Py_ssize_t p0 = 0; p0 < hw; p0 += LRN_TILE) {                                               \
                const Py_ssize_t m = hw - p0 < LRN_TILE ? hw - p0 : LRN_TILE, at0 = img * c * hw + p0;      \
                for (Py_ssize_t ch = 0; ch < c; ch++) {                                                      \
                    const Py_ssize_t at = at0 + ch * hw;                                                     \
                    T *restrict t = ratio + ch * LRN_TILE;                                                   \
                    for (Py_ssize_t i = 0; i < m; i++) t[i] = dy[at + i] * y[at + i] / scale[at + i];        \
                }                                                                                            \
                for (Py_ssize_t ch = 0; ch < c; ch++) {                                                      \
                    const Py_ssize_t at = at0 + ch * hw;                                                     \
                    T acc[LRN_TILE];                                                                         \
                    const T *restrict t = ratio + ch * LRN_TILE;                                             \
                    for (Py_ssize_t i = 0; i < m; i++) acc[i] = t[i];                                        \
                    for (Py_ssize_t d = 1; d <= r; d++) {                                                    \
                        if (ch - d >= 0) {                                                                   \
                            const T *restrict lo = ratio + (ch - d) * LRN_TILE;                              \
                            for (Py_ssize_t i = 0; i < m; i++) acc[i] += lo[i];                              \
                        }                                                                                    \
                        if (ch + d < c) {                                                                    \
                            const T *restrict hi = ratio + (ch + d) * LRN_TILE;                              \
                            for (Py_ssize_t i = 0; i < m; i++) acc[i] += hi[i];                              \
                        }                                                                                    \
                    }                                                                                        \
                    T *restrict g = dx + at;                                                                 \
                    for (Py_ssize_t i = 0; i < m; i++) {                                                     \
                        T root = SQRT_##T(scale[at + i]);                                                    \
                        T factor = (T)1 / (root * SQRT_##T(root));                                           \
                        g[i] = dy[at + i] * factor + acc[i] * x[at + i] * gain;                              \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
    }

#define SQRT_float sqrtf
#define SQRT_double sqrt
DEFINE_LRN(lrn_forward_f32, lrn_backward_f32, float)
DEFINE_LRN(lrn_forward_f64, lrn_backward_f64, double)

/* ---- ReLU backward ------------------------------------------------------------------------------------- */

/* dx = dy · (x > 0) on n values in one pass (numpy's dy times the boolean mask: NaN and ±inf gradients at
 * cells not above 0 give NaN, negative ones -0); dx may be dy (an in-place ReLU). */
/* numpy's maximum(w, 0) where `on`: w above 0, NaN kept, everything else (-0.0 too) +0 */
#define RECTIFIED(T, w, on) ((on) && !((w) > 0) && (w) == (w) ? (T)0 : (w))

/* Eltwise's sum of two bottoms, then (an in-place ReLU after it: cct.exec.fusion) numpy's maximum(., 0), in one
 * pass: the bits of numpy's add, then of the ReLU's forward. */
#define DEFINE_ADD_RECTIFIED(NAME, T)                                                                        \
    CCT_CLONES static void NAME(const T *a, const T *b, T *out, Py_ssize_t n) {                             \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                 \
            const T v = a[i] + b[i];                                                                         \
            out[i] = RECTIFIED(T, v, 1);                                                                     \
        }                                                                                                    \
    }
DEFINE_ADD_RECTIFIED(add_rectified_f32, float)
DEFINE_ADD_RECTIFIED(add_rectified_f64, double)

/* A convolution's output y (rows of `cells` values, row r of channel r % channels) plus its bias, then (an in-place
 * ReLU after it: cct.exec.fusion) numpy's maximum(., 0), in one pass over y: the bits of numpy's y += bias and of
 * the ReLU's forward.  Without a bias the values are only rectified (no + 0, which would turn -0.0 into +0). */
#define DEFINE_ADD_BIAS(NAME, T)                                                                             \
    CCT_CLONES static void NAME(T *y, const T *bias, Py_ssize_t rows, Py_ssize_t channels, Py_ssize_t cells,  \
                                int rectify) {                                                               \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                              \
            T *row = y + r * cells;                                                                          \
            if (bias) {                                                                                      \
                const T b = bias[r % channels];                                                              \
                if (rectify)                                                                                 \
                    for (Py_ssize_t i = 0; i < cells; i++) {                                                 \
                        const T v = row[i] + b;                                                              \
                        row[i] = RECTIFIED(T, v, 1);                                                         \
                    }                                                                                        \
                else                                                                                         \
                    for (Py_ssize_t i = 0; i < cells; i++) row[i] += b;                                      \
            } else if (rectify)                                                                              \
                for (Py_ssize_t i = 0; i < cells; i++) row[i] = RECTIFIED(T, row[i], 1);                     \
        }                                                                                                    \
    }
DEFINE_ADD_BIAS(add_bias_f32, float)
DEFINE_ADD_BIAS(add_bias_f64, double)

#define DEFINE_RELU_BACKWARD(NAME, T)                                                                        \
    CCT_CLONES static void NAME(const T *x, const T *dy, T *dx, Py_ssize_t n) {                             \
        /* the quiet comparison (the same truth values, NaN not above 0): with `>`, which may raise an       \
         * invalid-operation flag, GCC left AVX2 a scalar loop with a branch (13x slower on random signs) */  \
        for (Py_ssize_t i = 0; i < n; i++) dx[i] = dy[i] * (T)__builtin_isgreater(x[i], (T)0);               \
    }
DEFINE_RELU_BACKWARD(relu_backward_f32, float)
DEFINE_RELU_BACKWARD(relu_backward_f64, double)

/* ---- finiteness ----------------------------------------------------------------------------------------- */

/* Whether every one of n values is finite: no exponent field all ones (inf, NaN), tested on the bits with integer
 * operations in one read-only pass (a sum's finiteness tells the same but adds; numpy's reduction of CaffeNet's
 * 61M gradients took 27 ms, 1.9% of an iteration). */
#define DEFINE_ALL_FINITE(NAME, T, U, EXP)                                                                   \
    CCT_CLONES static int NAME(const T *x, Py_ssize_t n) {                                                   \
        const U *u = (const U *)x;                                                                           \
        U bad = 0;                                                                                           \
        for (Py_ssize_t i = 0; i < n; i++) bad |= (U)((u[i] & EXP) == EXP);                                  \
        return !bad;                                                                                         \
    }
DEFINE_ALL_FINITE(all_finite_f32, float, uint32_t, (uint32_t)0x7f800000u)
DEFINE_ALL_FINITE(all_finite_f64, double, uint64_t, (uint64_t)0x7ff0000000000000ull)

/* ---- transposition ------------------------------------------------------------------------------------ */

/* dst (cols, rows) = src (rows, cols) transposed, plus bias[i / cells] on source row i when bias is given: the
 * lowering's moves between images-last and images-first layouts, (C·cells, n) -> (n, C·cells) with the bias and
 * back without.  In TRANSPOSE_TILE x TRANSPOSE_TILE tiles, so that a tile's source rows stay in the cache while
 * its destination rows are written whole (numpy's strided copy of CaffeNet's conv4 output at 64 images, 384 x 169
 * cells: 23 ms, 7x a plain copy of the same bytes; these tiles 6.5 ms, 32 x 32 ones 8.2).  The same single add per
 * value as numpy's; with `rectify` (an in-place ReLU after the convolution) each row written is then numpy's
 * maximum(., 0) while in the cache. */
#define TRANSPOSE_TILE 64
#define DEFINE_TRANSPOSE(NAME, T)                                                                            \
    CCT_CLONES static void NAME(const T *restrict src, T *restrict dst, Py_ssize_t rows, Py_ssize_t cols,     \
                                const T *restrict bias, Py_ssize_t cells, int rectify) {                     \
        T b[TRANSPOSE_TILE];                                                                                 \
        for (Py_ssize_t i0 = 0; i0 < rows; i0 += TRANSPOSE_TILE) {                                           \
            const Py_ssize_t i1 = i0 + TRANSPOSE_TILE < rows ? i0 + TRANSPOSE_TILE : rows;                   \
            if (bias)                                                                                        \
                for (Py_ssize_t i = i0; i < i1; i++) b[i - i0] = bias[i / cells];                            \
            for (Py_ssize_t j0 = 0; j0 < cols; j0 += TRANSPOSE_TILE) {                                       \
                const Py_ssize_t j1 = j0 + TRANSPOSE_TILE < cols ? j0 + TRANSPOSE_TILE : cols;               \
                for (Py_ssize_t j = j0; j < j1; j++) {                                                       \
                    T *restrict d = dst + j * rows;                                                          \
                    const T *restrict from = src + j;                                                        \
                    if (bias)                                                                                \
                        for (Py_ssize_t i = i0; i < i1; i++) d[i] = from[i * cols] + b[i - i0];              \
                    else                                                                                     \
                        for (Py_ssize_t i = i0; i < i1; i++) d[i] = from[i * cols];                          \
                    if (rectify) /* the row just written, still in the cache */                              \
                        for (Py_ssize_t i = i0; i < i1; i++) d[i] = RECTIFIED(T, d[i], 1);                   \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_TRANSPOSE(transpose_f32, float)
DEFINE_TRANSPOSE(transpose_f64, double)

/* ---- SoftmaxWithLoss backward ------------------------------------------------------------------------- */

/* The labels as the numpy body reads them (read_labels in cct/layers/loss.py): truncated toward zero, a position
 * ignored where that equals the ignore label, else its class must lie in [0, classes).  Returns the number of
 * positions not ignored, or -1 where a label is out of range (the caller then reads them in numpy to say which). */
#define DEFINE_LABEL_COUNT(NAME, T)                                                                          \
    static Py_ssize_t NAME(const T *label, Py_ssize_t n, Py_ssize_t classes, int has_ignore, double ignore) { \
        Py_ssize_t count = 0;                                                                                \
        for (Py_ssize_t j = 0; j < n; j++) {                                                                 \
            double t = trunc((double)label[j]);                                                              \
            if (has_ignore && t == ignore) continue;                                                         \
            if (!(t >= 0 && t < (double)classes)) return -1;                                                 \
            count++;                                                                                         \
        }                                                                                                    \
        return count;                                                                                        \
    }
DEFINE_LABEL_COUNT(label_count_f32, float)
DEFINE_LABEL_COUNT(label_count_f64, double)

/* dx = (p - onehot(label)) · scale over (outer, classes, inner), the numpy body's roundings: p · scale everywhere,
 * (p - 1) · scale at each position's label (class 0 where ignored), then every class of an ignored position
 * times 0.  The labels were checked by label_count. */
#define DEFINE_SOFTMAX_LOSS_BACKWARD(NAME, T)                                                                \
    CCT_CLONES static void NAME(const T *p, const T *label, T *dx, Py_ssize_t outer, Py_ssize_t classes,     \
                                Py_ssize_t inner, T scale, int has_ignore, double ignore) {                  \
        const Py_ssize_t plane = classes * inner;                                                            \
        for (Py_ssize_t o = 0; o < outer; o++) {                                                             \
            const T *po = p + o * plane;                                                                     \
            T *dxo = dx + o * plane;                                                                         \
            for (Py_ssize_t j = 0; j < plane; j++) dxo[j] = po[j] * scale;                                   \
            for (Py_ssize_t i = 0; i < inner; i++) {                                                         \
                double t = trunc((double)label[o * inner + i]);                                              \
                int ignored = has_ignore && t == ignore;                                                     \
                Py_ssize_t at = (ignored ? 0 : (Py_ssize_t)t) * inner + i;                                   \
                dxo[at] = (T)(po[at] - (T)1) * scale;                                                        \
                if (ignored)                                                                                 \
                    for (Py_ssize_t c = 0; c < classes; c++) dxo[c * inner + i] *= (T)0;                     \
            }                                                                                                \
        }                                                                                                    \
    }
DEFINE_SOFTMAX_LOSS_BACKWARD(softmax_loss_backward_f32, float)
DEFINE_SOFTMAX_LOSS_BACKWARD(softmax_loss_backward_f64, double)

/* ---- depthwise convolution ---------------------------------------------------------------------------- */

/* A 2-D convolution with one input channel per group (depthwise: group = C, O = m·C outputs, output channel o
 * reading input channel o / m), directly: the lowering runs it as one GEMM of m rows per group.  Geometry g: n, c,
 * o, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow.
 *
 * Every pass reads planes laid out as wide rows: a plane (or each of its sh·sw stride phases, phase (a, b) holding
 * cells (u·sh + a, v·sw + b)) copied into a zero-bordered buffer whose rows are `pitch` values apart, so that
 * every tap of every computed cell (r, q) reads, at wide index i = r·pitch + q, the value at i plus the tap's shift
 * in one buffer: each tap is one contiguous pass over the whole plane, DW_WIDE cells (four vectors of sums) at a
 * time, and the columns q past the computed ones are computed and dropped.  Small planes (DW_STACK_PLANE) are
 * stacked: the same channel of up to `images` consecutive images, `span` rows apart (zero rows between them, so no
 * tap reaches a neighbour), make one buffer and one pass — a 7x7 plane alone is one step of four vectors between
 * its copies in and out; their planes are then taken channel by channel, (channel, image), other planes (image,
 * channel), as they lie.  The forward reads the input's phases; the data gradient, one pass per phase of dx,
 * reads the group's output gradients (each dx phase gathers the taps of that phase, their offsets flipped); the
 * weight gradient multiplies each tap's pass over the input's phases by the output gradient laid out as wide rows
 * (zero in the dropped columns and rows); where that layout and the data gradient's coincide (stride 1, one output
 * per channel, planes not stacked) both gradients run in one pass, dy laid out once (depthwise_backward()).  Each
 * value is summed in a fixed order (a cell over (output channel of the group, ky, kx) from 0, then the bias, as
 * Caffe's GEMM then bias; a weight's products in DW_BLOCK float lanes gathered into a double every DW_LANE_BLOCKS
 * blocks), the same whatever the thread count. */
#define DW_BLOCK 16
#define DW_WIDE (4 * DW_BLOCK)
#define DW_MAX_K 32         /* taps per axis, and the largest stride (RepLKNet's 31x31 kernels fit) */
#define DW_MAX_FAN 64       /* output channels per group */
#define DW_LANE_BLOCKS 64   /* a lane's float sum: at most this many products before it goes into the double */
#define DW_MAX_TAPS (DW_MAX_K * DW_MAX_K)
#define DW_STACK_PLANE 512  /* an image's cells in all the buffers of a pass: smaller planes are stacked, */
#define DW_STACK_CELLS 4096 /* as many images as fit in this many (28x28 planes alone: stacks of 4 measured slower) */

/* DW_BLOCK values as one vector (GCC's vector extension: the widest registers of each clone, in as many as it takes) */
typedef float depthwise_f32x __attribute__((vector_size(DW_BLOCK * sizeof(float))));
typedef double depthwise_f64x __attribute__((vector_size(DW_BLOCK * sizeof(double))));

typedef struct {
    Py_ssize_t rows, pitch, len, top, left;  /* every buffer's rows, row pitch and values; the image's corner in it */
    Py_ssize_t out_h, out_w, cells;          /* the cells a pass computes; wide: out_h·pitch (a full stack's) */
    Py_ssize_t images, span;                 /* images stacked in a buffer, rows from one to the next */
} dw_layout;

/* Plane `plane` of a pass over the planes of n images and `channels` channels, up to `last`: its channel and image
 * — planes taken (channel, image) where images are stacked, else (image, channel) — and the images of that channel
 * from it that one stack takes. */
static inline Py_ssize_t dw_stack_at(const dw_layout *l, Py_ssize_t plane, Py_ssize_t last, Py_ssize_t n,
                                     Py_ssize_t channels, Py_ssize_t *channel, Py_ssize_t *image) {
    const int stacked = l->images > 1;
    *channel = stacked ? plane / n : plane % channels;
    *image = stacked ? plane % n : plane / channels;
    Py_ssize_t k = n - *image < last - plane ? n - *image : last - plane;
    return k < l->images ? k : l->images;
}

/* The wide cells of a stack of k images. */
static inline Py_ssize_t dw_cells(const dw_layout *l, Py_ssize_t k) {
    return ((k - 1) * l->span + l->out_h) * l->pitch;
}

typedef struct {
    Py_ssize_t taps, weight[DW_MAX_TAPS], source[DW_MAX_TAPS], shift[DW_MAX_TAPS];  /* per tap: weight, buffer, shift */
    Py_ssize_t phase_h, phase_w, a, b;  /* (data gradient) the dx phase it computes */
} dw_pass;

static inline Py_ssize_t dw_floor_div(Py_ssize_t x, Py_ssize_t s) { return x >= 0 ? x / s : -((-x + s - 1) / s); }
static inline Py_ssize_t dw_phase_extent(Py_ssize_t n, Py_ssize_t s, Py_ssize_t a) {
    return n > a ? (n - a + s - 1) / s : 0;
}

/* The layout of `buffers` buffers for taps at phase offsets (uy, ux), reading planes of in_h x in_w (phases of at
 * most that) to compute out_h x out_w cells, stacking up to n images. */
static void dw_layout_for(dw_layout *l, const Py_ssize_t *uy, const Py_ssize_t *ux, Py_ssize_t taps, Py_ssize_t in_h,
                          Py_ssize_t in_w, Py_ssize_t out_h, Py_ssize_t out_w, Py_ssize_t n, Py_ssize_t buffers) {
    Py_ssize_t min_y = 0, max_y = 0, min_x = 0, max_x = 0;
    for (Py_ssize_t t = 0; t < taps; t++) {
        min_y = uy[t] < min_y ? uy[t] : min_y;
        max_y = uy[t] > max_y ? uy[t] : max_y;
        min_x = ux[t] < min_x ? ux[t] : min_x;
        max_x = ux[t] > max_x ? ux[t] : max_x;
    }
    l->top = -min_y;
    l->left = -min_x;
    l->pitch = l->left + (in_w > out_w + max_x ? in_w : out_w + max_x);
    /* image i's rows begin at row top + i·span: its last output's taps end before the next image's first row, and
     * its first output's taps begin after the previous image's last */
    l->span = out_h + max_y > l->top + in_h ? out_h + max_y : l->top + in_h;
    l->images = buffers * l->span * l->pitch > DW_STACK_PLANE ? 1 : DW_STACK_CELLS / (buffers * l->span * l->pitch);
    l->images = l->images < 1 ? 1 : l->images > n ? n : l->images;
    l->rows = l->top + (l->images - 1) * l->span + (in_h > out_h + max_y ? in_h : out_h + max_y);
    l->len = (l->rows + 1) * l->pitch + DW_WIDE;  /* a last step's dropped lanes read past the last row */
    l->out_h = out_h;
    l->out_w = out_w;
    l->cells = dw_cells(l, l->images);
}

/* The forward's (and the weight gradient's) pass over the input's sh·sw phases. */
static void dw_plan_forward(dw_layout *l, dw_pass *p, const Py_ssize_t *g) {
    const Py_ssize_t h = g[3], w = g[4], kh = g[5], kw = g[6], sh = g[7], sw = g[8], ph = g[9], pw = g[10],
                     dh = g[11], dw = g[12], oh = g[13], ow = g[14];
    Py_ssize_t uy[DW_MAX_TAPS], ux[DW_MAX_TAPS];
    p->taps = kh * kw;
    for (Py_ssize_t ky = 0; ky < kh; ky++)
        for (Py_ssize_t kx = 0; kx < kw; kx++) {
            const Py_ssize_t t = ky * kw + kx, oy = ky * dh - ph, ox = kx * dw - pw;
            uy[t] = dw_floor_div(oy, sh);
            ux[t] = dw_floor_div(ox, sw);
            p->weight[t] = t;
            p->source[t] = (oy - uy[t] * sh) * sw + (ox - ux[t] * sw);
        }
    dw_layout_for(l, uy, ux, p->taps, dw_phase_extent(h, sh, 0), dw_phase_extent(w, sw, 0), oh, ow, g[0], sh * sw);
    for (Py_ssize_t t = 0; t < p->taps; t++)
        p->shift[t] = p->source[t] * l->len + (uy[t] + l->top) * l->pitch + ux[t] + l->left;
}

/* The data gradient's passes, one per phase (a, b) of dx: its taps' offsets flipped, over the output gradients. */
static void dw_plan_data(dw_layout *l, dw_pass *passes, const Py_ssize_t *g) {
    const Py_ssize_t h = g[3], w = g[4], kh = g[5], kw = g[6], sh = g[7], sw = g[8], ph = g[9], pw = g[10],
                     dh = g[11], dw = g[12], oh = g[13], ow = g[14];
    Py_ssize_t uy[DW_MAX_TAPS], ux[DW_MAX_TAPS];
    for (Py_ssize_t a = 0; a < sh; a++)
        for (Py_ssize_t b = 0; b < sw; b++) {
            dw_pass *p = passes + a * sw + b;
            p->taps = 0;
            p->a = a;
            p->b = b;
            p->phase_h = dw_phase_extent(h, sh, a);
            p->phase_w = dw_phase_extent(w, sw, b);
        }
    for (Py_ssize_t ky = 0; ky < kh; ky++)
        for (Py_ssize_t kx = 0; kx < kw; kx++) {
            const Py_ssize_t t = ky * kw + kx, oy = ky * dh - ph, ox = kx * dw - pw;
            const Py_ssize_t fy = dw_floor_div(oy, sh), fx = dw_floor_div(ox, sw);
            dw_pass *p = passes + (oy - fy * sh) * sw + (ox - fx * sw);
            p->weight[p->taps] = t;
            p->source[p->taps] = 0;
            uy[t] = -fy;  /* dx phase cell (u, v) reads dy at (u - fy, v - fx) */
            ux[t] = -fx;
            p->shift[p->taps++] = t;  /* (the tap, for now) */
        }
    dw_layout_for(l, uy, ux, kh * kw, oh, ow, dw_phase_extent(h, sh, 0), dw_phase_extent(w, sw, 0), g[0], g[2] / g[1]);
    for (Py_ssize_t i = 0; i < sh * sw; i++)
        for (Py_ssize_t k = 0; k < passes[i].taps; k++) {
            const Py_ssize_t t = passes[i].shift[k];
            passes[i].shift[k] = (uy[t] + l->top) * l->pitch + ux[t] + l->left;
        }
}

/* rows x count values (width <= count < 2·width) from src to dst, rows src_pitch and dst_pitch apart, each row in
 * two moves of a VT of `width` values, the second overlapping the first */
#define DW_ROWS_IN_TWO_MOVES(VT, width, dst, dst_pitch, src, src_pitch, rows, count)                                 \
    do {                                                                                                             \
        for (Py_ssize_t r_ = 0; r_ < (rows); r_++) {                                                                 \
            VT a_, b_;                                                                                               \
            memcpy(&a_, (src) + r_ * (src_pitch), sizeof a_);                                                        \
            memcpy(&b_, (src) + r_ * (src_pitch) + (count) - (width), sizeof b_);                                    \
            memcpy((dst) + r_ * (dst_pitch), &a_, sizeof a_);                                                        \
            memcpy((dst) + r_ * (dst_pitch) + (count) - (width), &b_, sizeof b_);                                    \
        }                                                                                                            \
    } while (0)

#define DEFINE_DEPTHWISE(NAME, T, V)                                                                                 \
    typedef T NAME##_v4 __attribute__((vector_size(4 * sizeof(T))));                                                 \
    typedef T NAME##_v8 __attribute__((vector_size(8 * sizeof(T))));                                                 \
    /* rows x count values from src to dst (rows src_pitch and dst_pitch apart): a row of fewer than 16 values in    \
     * two vector moves, the second overlapping the first (a 7-value row is two 4-value moves, where a loop of       \
     * single values costs a load, a store and a branch each: 7x7 planes 1.5x faster); longer rows as a plain loop   \
     * (which the compiler vectorizes, measured faster there) */                                                     \
    static inline void NAME##_rows(T *restrict dst, Py_ssize_t dst_pitch, const T *restrict src,                     \
                                   Py_ssize_t src_pitch, Py_ssize_t rows, Py_ssize_t count) {                        \
        if (count >= 16 || count < 4) {                                                                              \
            for (Py_ssize_t r = 0; r < rows; r++)                                                                    \
                for (Py_ssize_t v = 0; v < count; v++) dst[r * dst_pitch + v] = src[r * src_pitch + v];              \
        } else if (count >= 8)                                                                                       \
            DW_ROWS_IN_TWO_MOVES(NAME##_v8, 8, dst, dst_pitch, src, src_pitch, rows, count);                         \
        else                                                                                                         \
            DW_ROWS_IN_TWO_MOVES(NAME##_v4, 4, dst, dst_pitch, src, src_pitch, rows, count);                         \
    }                                                                                                                \
    /* plane (h x w) into the buffers of its sh·sw phases (each l->len values; borders left as they are: zero) */    \
    CCT_CLONES CCT_INLINE_COPIES static void NAME##_fill(const T *restrict src, T *restrict buf, const dw_layout *l, \
                                                         Py_ssize_t h, Py_ssize_t w, Py_ssize_t sh, Py_ssize_t sw) { \
        if (sh == 1 && sw == 1) {                                                                                    \
            T *restrict to = buf + l->top * l->pitch + l->left;                                                      \
            NAME##_rows(to, l->pitch, src, w, h, w);                                                                 \
            return;                                                                                                  \
        }                                                                                                            \
        for (Py_ssize_t y = 0; y < h; y++) {  /* row y is row y / sh of the phases (y % sh, b) */                    \
            const T *restrict row = src + y * w;                                                                     \
            T *restrict to = buf + (y % sh) * sw * l->len + (y / sh + l->top) * l->pitch + l->left;                  \
            if (sw == 1)                                                                                             \
                NAME##_rows(to, 0, row, 0, 1, w);                                                                    \
            else if (sw == 2) {  /* (a constant stride: the split vectorizes) */                                     \
                T *restrict odd = to + l->len;                                                                       \
                for (Py_ssize_t v = 0; v < w / 2; v++) {                                                             \
                    to[v] = row[2 * v];                                                                              \
                    odd[v] = row[2 * v + 1];                                                                         \
                }                                                                                                    \
                if (w % 2) to[w / 2] = row[w - 1];                                                                   \
            } else                                                                                                   \
                for (Py_ssize_t b = 0; b < sw; b++)                                                                  \
                    for (Py_ssize_t v = 0; v < dw_phase_extent(w, sw, b); v++) to[b * l->len + v] = row[v * sw + b]; \
        }                                                                                                            \
    }                                                                                                                \
    /* wide[i] = Σ_{j < fan} Σ_{taps} k[j·stride + weight] · buf[j·fan_len + i + shift], i < cells (a tap's shift    \
     * includes its buffer's place) */                                                                               \
    CCT_CLONES static void NAME##_sum(const T *buf, const T *k, Py_ssize_t fan, Py_ssize_t fan_len,                  \
                                      Py_ssize_t k_stride, const dw_pass *p, Py_ssize_t cells, T *restrict wide) {   \
        const Py_ssize_t taps = p->taps, *shift = p->shift, *weight = p->weight;                                     \
        for (Py_ssize_t i = 0; i < cells; i += DW_WIDE) {                                                            \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                                                \
            for (Py_ssize_t j = 0; j < fan; j++) {                                                                   \
                const T *bj = buf + j * fan_len + i, *kj = k + j * k_stride;                                         \
                for (Py_ssize_t t = 0; t < taps; t++) {                                                              \
                    const T *from = bj + shift[t];                                                                   \
                    const T v = kj[weight[t]];                                                                       \
                    V c0, c1, c2, c3;                                                                                \
                    memcpy(&c0, from, sizeof c0);                                                                    \
                    memcpy(&c1, from + DW_BLOCK, sizeof c1);                                                         \
                    memcpy(&c2, from + 2 * DW_BLOCK, sizeof c2);                                                     \
                    memcpy(&c3, from + 3 * DW_BLOCK, sizeof c3);                                                     \
                    a0 += v * c0;                                                                                    \
                    a1 += v * c1;                                                                                    \
                    a2 += v * c2;                                                                                    \
                    a3 += v * c3;                                                                                    \
                }                                                                                                    \
            }                                                                                                        \
            memcpy(wide + i, &a0, sizeof a0);                                                                        \
            memcpy(wide + i + DW_BLOCK, &a1, sizeof a1);                                                             \
            memcpy(wide + i + 2 * DW_BLOCK, &a2, sizeof a2);                                                         \
            memcpy(wide + i + 3 * DW_BLOCK, &a3, sizeof a3);                                                         \
        }                                                                                                            \
    }                                                                                                                \
    /* y planes (output channel, image) [first, last) (+ bias), the images of a channel in stacks; buf: sh·sw zeroed \
     * buffers, wide: l->cells + DW_WIDE */                                                                          \
    CCT_CLONES CCT_INLINE_COPIES static void NAME##_forward(const T *x, const T *wt, const T *bias, T *y,            \
                                                            const Py_ssize_t *g, const dw_layout *l,                 \
                                                            const dw_pass *p, Py_ssize_t first, Py_ssize_t last,     \
                                                            T *buf, T *wide) {                                       \
        const Py_ssize_t n = g[0], c = g[1], o = g[2], h = g[3], w = g[4], sh = g[7], sw = g[8], oh = g[13],         \
                         ow = g[14], step = l->span * l->pitch;                                                      \
        for (Py_ssize_t plane = first; plane < last;) {                                                              \
            Py_ssize_t co, img;                                                                                      \
            const Py_ssize_t k = dw_stack_at(l, plane, last, n, o, &co, &img);                                       \
            for (Py_ssize_t i = 0; i < k; i++)                                                                       \
                NAME##_fill(x + ((img + i) * c + co / (o / c)) * h * w, buf + i * step, l, h, w, sh, sw);            \
            NAME##_sum(buf, wt + co * p->taps, 1, 0, 0, p, dw_cells(l, k), wide);                                    \
            for (Py_ssize_t i = 0; i < k; i++) {                                                                     \
                T *out = y + ((img + i) * o + co) * oh * ow;                                                         \
                const T *from = wide + i * step, add = bias ? bias[co] : 0;                                          \
                if (bias)                                                                                            \
                    for (Py_ssize_t r = 0; r < oh; r++)                                                              \
                        for (Py_ssize_t q = 0; q < ow; q++) out[r * ow + q] = from[r * l->pitch + q] + add;          \
                else                                                                                                 \
                    NAME##_rows(out, ow, from, l->pitch, oh, ow);                                                    \
            }                                                                                                        \
            plane += k;                                                                                              \
        }                                                                                                            \
    }                                                                                                                \
    /* The dx planes of input channel ci, images [img, img + k), from the group's output gradients in buf (m         \
     * buffers, the stack filled): each phase of dx one pass, its cells moved into dx */                             \
    CCT_CLONES static void NAME##_data_stack(const T *buf, const T *wt, T *dx, const Py_ssize_t *g, const dw_layout *l, \
                                             const dw_pass *passes, Py_ssize_t ci, Py_ssize_t img, Py_ssize_t k,     \
                                             T *wide) {                                                              \
        const Py_ssize_t c = g[1], o = g[2], h = g[3], w = g[4], kh = g[5], kw = g[6], sh = g[7], sw = g[8],         \
                         m = o / c, step = l->span * l->pitch;                                                       \
        for (Py_ssize_t s = 0; s < sh * sw; s++) {                                                                   \
            const dw_pass *p = passes + s;                                                                           \
            NAME##_sum(buf, wt + ci * m * kh * kw, m, l->len, kh * kw, p, dw_cells(l, k), wide);                     \
            for (Py_ssize_t i = 0; i < k; i++) {                                                                     \
                T *out = dx + ((img + i) * c + ci) * h * w;                                                          \
                const T *from = wide + i * step;                                                                     \
                if (sw == 1)                                                                                         \
                    NAME##_rows(out + p->a * w, sh * w, from, l->pitch, p->phase_h, p->phase_w);                     \
                else                                                                                                 \
                    for (Py_ssize_t u = 0; u < p->phase_h; u++)                                                      \
                        for (Py_ssize_t v = 0; v < p->phase_w; v++)                                                  \
                            out[(u * sh + p->a) * w + v * sw + p->b] = from[u * l->pitch + v];                       \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    /* dx planes (input channel, image) [first, last), the images of a channel in stacks, each phase of dx one pass  \
     * over the group's m output gradients; buf: m zeroed buffers, wide: l->cells + DW_WIDE */                       \
    CCT_CLONES CCT_INLINE_COPIES static void NAME##_data(const T *dy, const T *wt, T *dx, const Py_ssize_t *g,       \
                                                         const dw_layout *l, const dw_pass *passes,                  \
                                                         Py_ssize_t first, Py_ssize_t last, T *buf, T *wide) {       \
        const Py_ssize_t n = g[0], c = g[1], o = g[2], oh = g[13], ow = g[14], m = o / c, step = l->span * l->pitch; \
        for (Py_ssize_t plane = first; plane < last;) {                                                              \
            Py_ssize_t ci, img;                                                                                      \
            const Py_ssize_t k = dw_stack_at(l, plane, last, n, c, &ci, &img);                                       \
            for (Py_ssize_t j = 0; j < m; j++)                                                                       \
                for (Py_ssize_t i = 0; i < k; i++)                                                                   \
                    NAME##_fill(dy + ((img + i) * o + ci * m + j) * oh * ow, buf + j * l->len + i * step, l, oh, ow, \
                                1, 1);                                                                               \
            NAME##_data_stack(buf, wt, dx, g, l, passes, ci, img, k, wide);                                          \
            plane += k;                                                                                              \
        }                                                                                                            \
    }                                                                                                                \
    /* A channel's weight gradient begun: its lanes and sums at zero (returns the block count, 0) */                 \
    static inline Py_ssize_t NAME##_clear(V *lanes, double *acc, Py_ssize_t taps) {                                  \
        for (Py_ssize_t t = 0; t < taps; t++) {                                                                      \
            acc[t] = 0;                                                                                              \
            lanes[t] = (V){0};                                                                                       \
        }                                                                                                            \
        return 0;                                                                                                    \
    }                                                                                                                \
    /* ... and ended: its sums added to dw[co] */                                                                    \
    static inline void NAME##_store(T *dwt, Py_ssize_t co, const dw_pass *p, const double *acc) {                    \
        for (Py_ssize_t t = 0; t < p->taps; t++) dwt[co * p->taps + p->weight[t]] += (T)acc[t];                      \
    }                                                                                                                \
    /* The weight gradient's products over a stack's `cells` wide cells: per tap, grad times the tap's shifted       \
     * values of buf, DW_BLOCK float lanes each, gathered into acc's doubles every DW_LANE_BLOCKS blocks (*blocks    \
     * counts them across stacks) and after the last block of the `last` stack */                                    \
    static inline void NAME##_products(const T *grad, const T *buf, const dw_pass *p, Py_ssize_t cells, int last,    \
                                       V *lanes, double *acc, Py_ssize_t *blocks) {                                  \
        const Py_ssize_t taps = p->taps;                                                                             \
        for (Py_ssize_t i = 0; i < cells; i += DW_BLOCK) {                                                           \
            V d;                                                                                                     \
            memcpy(&d, grad + i, sizeof d);                                                                          \
            for (Py_ssize_t t = 0; t < taps; t++) {                                                                  \
                V values;                                                                                            \
                memcpy(&values, buf + i + p->shift[t], sizeof values);                                               \
                lanes[t] += d * values;                                                                              \
            }                                                                                                        \
            if (++*blocks == DW_LANE_BLOCKS || (last && i + DW_BLOCK >= cells)) {                                    \
                for (Py_ssize_t t = 0; t < taps; t++) {                                                              \
                    double sum = 0;                                                                                  \
                    for (int b = 0; b < DW_BLOCK; b++) sum += lanes[t][b];                                           \
                    acc[t] += sum;                                                                                   \
                    lanes[t] = (V){0};                                                                               \
                }                                                                                                    \
                *blocks = 0;                                                                                         \
            }                                                                                                        \
        }                                                                                                            \
    }                                                                                                                \
    /* dw[co] += per tap the products of the output gradient's wide rows and the tap's pass over the input's phases, \
     * output channels [first, last), the images in stacks; buf: sh·sw zeroed buffers, grad: l->cells + DW_WIDE      \
     * zeroed values, lanes: kh·kw vectors, acc: kh·kw doubles */                                                    \
    CCT_CLONES CCT_INLINE_COPIES static void NAME##_weights(const T *x, const T *dy, T *dwt, const Py_ssize_t *g,    \
                                                            const dw_layout *l, const dw_pass *p, Py_ssize_t first,  \
                                                            Py_ssize_t last, T *buf, T *grad, V *lanes,              \
                                                            double *acc) {                                           \
        const Py_ssize_t n = g[0], c = g[1], o = g[2], h = g[3], w = g[4], sh = g[7], sw = g[8], oh = g[13],         \
                         ow = g[14], m = o / c, taps = p->taps, step = l->span * l->pitch;                           \
        Py_ssize_t held = 0; /* images whose values the buffers hold */                                              \
        for (Py_ssize_t co = first; co < last; co++) {                                                               \
            Py_ssize_t blocks = NAME##_clear(lanes, acc, taps);                                                      \
            for (Py_ssize_t img = 0; img < n; img += l->images) {                                                    \
                const Py_ssize_t k = n - img < l->images ? n - img : l->images, cells = dw_cells(l, k);              \
                if (k < held) /* a shorter stack: the gradient past it back to zeros (its last block may read it) */ \
                    memset(grad + k * step, 0, (size_t)((held - k) * step) * sizeof(T));                             \
                held = k;                                                                                            \
                for (Py_ssize_t i = 0; i < k; i++) {                                                                 \
                    NAME##_fill(x + ((img + i) * c + co / m) * h * w, buf + i * step, l, h, w, sh, sw);              \
                    const T *from = dy + ((img + i) * o + co) * oh * ow;                                             \
                    NAME##_rows(grad + i * step, l->pitch, from, ow, oh, ow);                                        \
                }                                                                                                    \
                NAME##_products(grad, buf, p, cells, img + k == n, lanes, acc, &blocks);                             \
            }                                                                                                        \
            NAME##_store(dwt, co, p, acc);                                                                           \
        }                                                                                                            \
    }                                                                                                                \
    /* Both gradients of channels [first, last) of a layer of one output per channel, stride 1, whose forward and    \
     * data layouts coincide, one image a buffer (depthwise_backward()): per image, x into buf (the forward's        \
     * layout) and dy into dbuf (the data gradient's), dx by the data pass over dbuf, dw from the products of dy read \
     * in dbuf (the forward's wide rows at an offset: zeros in the dropped columns) and buf's taps — dy read and laid \
     * out once for both, the bits of NAME##_data and NAME##_weights; dbuf: l->len zeroed values, the rest as theirs */ \
    CCT_CLONES CCT_INLINE_COPIES static void NAME##_both(const T *x, const T *dy, const T *wt, T *dx, T *dwt,        \
                                                         const Py_ssize_t *g, const dw_layout *lf, const dw_pass *pf, \
                                                         const dw_layout *ld, const dw_pass *passes,                 \
                                                         Py_ssize_t first, Py_ssize_t last, T *buf, T *dbuf,         \
                                                         T *wide, V *lanes, double *acc) {                           \
        const Py_ssize_t n = g[0], c = g[1], h = g[3], w = g[4], oh = g[13], ow = g[14], taps = pf->taps,            \
                         offset = ld->top * ld->pitch + ld->left;                                                    \
        for (Py_ssize_t co = first; co < last; co++) {                                                               \
            Py_ssize_t blocks = NAME##_clear(lanes, acc, taps);                                                      \
            for (Py_ssize_t img = 0; img < n; img++) {                                                               \
                NAME##_fill(x + (img * c + co) * h * w, buf, lf, h, w, 1, 1);                                        \
                NAME##_fill(dy + (img * c + co) * oh * ow, dbuf, ld, oh, ow, 1, 1);                                  \
                NAME##_data_stack(dbuf, wt, dx, g, ld, passes, co, img, 1, wide);                                    \
                NAME##_products(dbuf + offset, buf, pf, dw_cells(lf, 1), img + 1 == n, lanes, acc, &blocks);         \
            }                                                                                                        \
            NAME##_store(dwt, co, pf, acc);                                                                          \
        }                                                                                                            \
    }
DEFINE_DEPTHWISE(depthwise_f32, float, depthwise_f32x)
DEFINE_DEPTHWISE(depthwise_f64, double, depthwise_f64x)

/* ---- SGD update ---------------------------------------------------------------------------------------- */

/* Caffe's SGD step (cct/solvers/sgd.py) on n values, each in one pass: g *= norm (when `normalize`); g += decay·w
 * (L2) or decay·sign(w) (L1), when decay != 0; g *= rate; h = h·momentum + g; g = h; w -= g.  The numpy body's
 * float operations, one rounding each, in its order (sign as numpy's: 0 for ±0, NaN kept). */
#define SIGN(v) ((v) > 0 ? 1 : (v) < 0 ? -1 : (v) == 0 ? 0 : (v))
#define DEFINE_SGD(NAME, T)                                                                                  \
    CCT_CLONES static void NAME(T *restrict w, T *restrict g, T *restrict h, Py_ssize_t n, int normalize,    \
                                T norm, T decay, int l1, T rate, T momentum) {                               \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                 \
            T v = g[i];                                                                                      \
            if (normalize) v = v * norm;                                                                     \
            if (decay != 0) {                                                                                \
                T t = l1 ? (T)SIGN(w[i]) * decay : w[i] * decay;                                             \
                v = v + t;                                                                                   \
            }                                                                                                \
            v = v * rate;                                                                                    \
            T m = h[i] * momentum;                                                                           \
            m = m + v;                                                                                       \
            g[i] = m;                                                                                        \
            h[i] = m;                                                                                        \
            w[i] = w[i] - m;                                                                                 \
        }                                                                                                    \
    }
DEFINE_SGD(sgd_f32, float)
DEFINE_SGD(sgd_f64, double)

/* ---- per-channel rows (BatchNorm, Scale) ------------------------------------------------------------------
 * The values are rows of `cells` (one image's channel plane), row r belonging to channel r mod `channels` of the
 * per-channel vectors given; each row is one pass while it is in the core's cache.  The elementwise results are
 * the numpy bodies' operations in their order, one rounding each (cct/layers/normalization.py, scale.py); a row's
 * sums are accumulated in double precision in ROW_LANES lanes (the numpy bodies' float sums, in their BLAS's
 * order, agree to rounding): 32, four vectors of independent sums (with 8, one vector, each step waited for the
 * last: BatchNorm's backward sums 1.7x slower).  An output may be its input (in place); the other outputs never
 * overlap. */
#define ROW_LANES 32

/* Σ TERM(i) over a row of `cells`, in ROW_LANES double lanes (a, b: the row's operands; shift: a row value). */
#define DEFINE_ROW_SUM(NAME, T, TERM)                                                                          \
    static inline double NAME(const T *a, const T *b, T shift, Py_ssize_t cells) {                              \
        double acc[ROW_LANES] = {0}, s = 0;                                                                     \
        Py_ssize_t i = 0;                                                                                       \
        (void)b;                                                                                                \
        (void)shift;                                                                                            \
        for (; i + ROW_LANES <= cells; i += ROW_LANES)                                                          \
            for (int l = 0; l < ROW_LANES; l++) acc[l] += TERM(T, i + l);                                       \
        for (; i < cells; i++) s += TERM(T, i);                                                                 \
        for (int l = 0; l < ROW_LANES; l++) s += acc[l];                                                        \
        return s;                                                                                               \
    }
#define PLAIN(T, i) (double)a[i]
#define SQUARED_DEVIATION(T, i) ((double)(T)(a[i] - shift) * (double)(T)(a[i] - shift))
DEFINE_ROW_SUM(row_sum_f32, float, PLAIN)
DEFINE_ROW_SUM(row_sum_f64, double, PLAIN)
DEFINE_ROW_SUM(row_deviation_f32, float, SQUARED_DEVIATION)
DEFINE_ROW_SUM(row_deviation_f64, double, SQUARED_DEVIATION)

/* Per row: its mean (the sum over `cells` divided by them, rounded to T) and the sum of the squares of its
 * deviations from that mean (each deviation rounded to T, as the numpy body's difference array is). */
#define DEFINE_ROW_MOMENTS(NAME, T, SUM, DEVIATION)                                                           \
    CCT_CLONES static void NAME(const T *x, T *mean, T *m2, Py_ssize_t rows, Py_ssize_t cells) {               \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const T *v = x + r * cells;                                                                         \
            T mu = (T)(SUM(v, NULL, 0, cells) / (double)cells);                                                 \
            mean[r] = mu;                                                                                       \
            m2[r] = (T)DEVIATION(v, NULL, mu, cells);                                                           \
        }                                                                                                       \
    }
DEFINE_ROW_MOMENTS(row_moments_f32, float, row_sum_f32, row_deviation_f32)
DEFINE_ROW_MOMENTS(row_moments_f64, double, row_sum_f64, row_deviation_f64)

/* Per row: the sum of a, and of a·b when b is given — both in one read of the row, each in its own lanes (the
 * bits of SUM and DOT apart). */
#define DEFINE_ROW_SUMS(NAME, T, SUM)                                                                          \
    CCT_CLONES static void NAME(const T *a, const T *b, T *sums, T *dots, Py_ssize_t rows, Py_ssize_t cells) { \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const T *x = a + r * cells, *y = b ? b + r * cells : NULL;                                          \
            if (!y) {                                                                                           \
                sums[r] = (T)SUM(x, NULL, 0, cells);                                                            \
                continue;                                                                                       \
            }                                                                                                   \
            double sa[ROW_LANES] = {0}, da[ROW_LANES] = {0}, s = 0, d = 0;                                      \
            Py_ssize_t i = 0;                                                                                   \
            for (; i + ROW_LANES <= cells; i += ROW_LANES)                                                      \
                for (int l = 0; l < ROW_LANES; l++) {                                                           \
                    sa[l] += (double)x[i + l];                                                                  \
                    da[l] += (double)x[i + l] * (double)y[i + l];                                               \
                }                                                                                               \
            for (; i < cells; i++) {                                                                            \
                s += (double)x[i];                                                                              \
                d += (double)x[i] * (double)y[i];                                                               \
            }                                                                                                   \
            for (int l = 0; l < ROW_LANES; l++) {                                                               \
                s += sa[l];                                                                                     \
                d += da[l];                                                                                     \
            }                                                                                                   \
            sums[r] = (T)s;                                                                                     \
            dots[r] = (T)d;                                                                                     \
        }                                                                                                       \
    }
DEFINE_ROW_SUMS(row_sums_f32, float, row_sum_f32)
DEFINE_ROW_SUMS(row_sums_f64, double, row_sum_f64)

/* One elementwise pass over a row: each output value w_ = EXPR of v = x[i] (and of U = other[i], a second input),
 * in place (o == x) or into an output that does not overlap the input; `extra` (overlapping neither) gets KEEP. */
#define ROW_PASS(T, x, other, o, extra, cells, EXPR, KEEP)                                                      \
    do {                                                                                                        \
        const T *restrict u_ = (other);                                                                         \
        T *restrict ex_ = (extra);                                                                              \
        (void)u_;                                                                                               \
        (void)ex_;                                                                                              \
        if ((const T *)(o) == (x)) {                                                                            \
            T *io_ = (o);                                                                                       \
            for (Py_ssize_t i_ = 0; i_ < (cells); i_++) {                                                       \
                const T v = io_[i_], w_ = (EXPR);                                                                \
                KEEP;                                                                                           \
                io_[i_] = w_;                                                                                   \
            }                                                                                                   \
        } else {                                                                                                \
            const T *restrict in_ = (x);                                                                        \
            T *restrict out_ = (o);                                                                             \
            for (Py_ssize_t i_ = 0; i_ < (cells); i_++) {                                                       \
                const T v = in_[i_], w_ = (EXPR);                                                                \
                KEEP;                                                                                           \
                out_[i_] = w_;                                                                                  \
            }                                                                                                   \
        }                                                                                                       \
    } while (0)
#define U (u_[i_])
#define KEEP_NOTHING (void)0
#define KEEP_OUTPUT ex_[i_] = w_
#define KEEP_INPUT ex_[i_] = v

/* BatchNorm forward: out = (x - mean[c]) / std[c] (x / std[c] without a mean: its backward with global
 * statistics), and copy = out when given. */
#define DEFINE_NORMALIZE_ROWS(NAME, T)                                                                         \
    CCT_CLONES static void NAME(const T *x, const T *mean, const T *std, T *out, T *copy, Py_ssize_t rows,     \
                                Py_ssize_t channels, Py_ssize_t cells) {                                        \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const T *xr = x + r * cells;                                                                        \
            T *outr = out + r * cells, *copyr = copy ? copy + r * cells : NULL;                                 \
            const T m = mean ? mean[r % channels] : 0, s = std[r % channels];                                   \
            if (!mean)                                                                                          \
                ROW_PASS(T, xr, NULL, outr, NULL, cells, v / s, KEEP_NOTHING);                                  \
            else if (copyr)                                                                                     \
                ROW_PASS(T, xr, NULL, outr, copyr, cells, (v - m) / s, KEEP_OUTPUT);                            \
            else                                                                                                \
                ROW_PASS(T, xr, NULL, outr, NULL, cells, (v - m) / s, KEEP_NOTHING);                            \
        }                                                                                                       \
    }
DEFINE_NORMALIZE_ROWS(normalize_rows_f32, float)
DEFINE_NORMALIZE_ROWS(normalize_rows_f64, double)

/* Scale: out = x * scale[c] (+ bias[c]), saving x into `save` first when given (in place, for its gradient). */
#define DEFINE_SCALE_ROWS(NAME, T)                                                                             \
    CCT_CLONES static void NAME(const T *x, const T *scale, const T *bias, T *out, T *save, Py_ssize_t rows,   \
                                Py_ssize_t channels, Py_ssize_t cells) {                                        \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const T *xr = x + r * cells;                                                                        \
            T *outr = out + r * cells, *saver = save ? save + r * cells : NULL;                                 \
            const T a = scale[r % channels], b = bias ? bias[r % channels] : 0;                                 \
            if (bias && saver)                                                                                  \
                ROW_PASS(T, xr, NULL, outr, saver, cells, v * a + b, KEEP_INPUT);                               \
            else if (bias)                                                                                      \
                ROW_PASS(T, xr, NULL, outr, NULL, cells, v * a + b, KEEP_NOTHING);                              \
            else if (saver)                                                                                     \
                ROW_PASS(T, xr, NULL, outr, saver, cells, v * a, KEEP_INPUT);                                   \
            else                                                                                                \
                ROW_PASS(T, xr, NULL, outr, NULL, cells, v * a, KEEP_NOTHING);                                  \
        }                                                                                                       \
    }
DEFINE_SCALE_ROWS(scale_rows_f32, float)
DEFINE_SCALE_ROWS(scale_rows_f64, double)

/* BatchNorm backward with batch statistics: out = (dy - (y * a[c] + b[c])) / std[c] (a = mean(dy·y), b =
 * mean(dy)); out may be dy. */
#define DEFINE_NORMALIZE_BACKWARD_ROWS(NAME, T)                                                                \
    CCT_CLONES static void NAME(const T *dy, const T *y, const T *a, const T *b, const T *std, T *out,          \
                                Py_ssize_t rows, Py_ssize_t channels, Py_ssize_t cells) {                       \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const T ar = a[r % channels], br = b[r % channels], s = std[r % channels];                          \
            ROW_PASS(T, dy + r * cells, y + r * cells, out + r * cells, NULL, cells, (v - (U * ar + br)) / s,   \
                     KEEP_NOTHING);                                                                             \
        }                                                                                                       \
    }
DEFINE_NORMALIZE_BACKWARD_ROWS(normalize_backward_rows_f32, float)
DEFINE_NORMALIZE_BACKWARD_ROWS(normalize_backward_rows_f64, double)

/* BatchNorm then an in-place per-channel Scale as one pass (cct/exec/fusion.py): copy = (x - mean[c]) / std[c] (x /
 * std[c] without a mean), the BatchNorm's top, kept; out = copy * scale[c] (+ bias[c]), the Scale's — the bits
 * of the two layers' passes one after the other. */
#define DEFINE_NORMALIZE_SCALE_ROWS(NAME, T)                                                                   \
    CCT_CLONES static void NAME(const T *x, const T *mean, const T *std, const T *scale, const T *bias, T *out, \
                                T *copy, Py_ssize_t rows, Py_ssize_t channels, Py_ssize_t cells, int rectify) { \
        for (Py_ssize_t r = 0; r < rows; r++) {                                                                \
            const Py_ssize_t c = r % channels;                                                                  \
            const T m = mean ? mean[c] : 0, s = std[c], a = scale[c], b = bias ? bias[c] : 0;                   \
            const T *xr = x + r * cells;                                                                        \
            T *outr = out + r * cells, *copyr = copy + r * cells;                                               \
            if (mean && bias)                                                                                   \
                ROW_PASS(T, xr, NULL, outr, copyr, cells, RECTIFIED(T, ((v - m) / s) * a + b, rectify),          \
                         ex_[i_] = (v - m) / s);                                                                \
            else if (mean)                                                                                      \
                ROW_PASS(T, xr, NULL, outr, copyr, cells, RECTIFIED(T, ((v - m) / s) * a, rectify),              \
                         ex_[i_] = (v - m) / s);                                                                \
            else if (bias)                                                                                      \
                ROW_PASS(T, xr, NULL, outr, copyr, cells, RECTIFIED(T, (v / s) * a + b, rectify), ex_[i_] = v / s); \
            else                                                                                                \
                ROW_PASS(T, xr, NULL, outr, copyr, cells, RECTIFIED(T, (v / s) * a, rectify), ex_[i_] = v / s);  \
        }                                                                                                       \
    }
DEFINE_NORMALIZE_SCALE_ROWS(normalize_scale_rows_f32, float)
DEFINE_NORMALIZE_SCALE_ROWS(normalize_scale_rows_f64, double)

/* Winograd's tile transforms (cct/engines/winograd.py), channels innermost: F(m x m, 3 x 3)'s 1-D matrices applied
 * down a tile's rows, then across, WINO_BLOCK channels at a time (the vector lanes).  The matrices are constants
 * here (the engine's _TRANSFORMS; its tests hold the two to the same values), so that each transform compiles to
 * straight-line code: the zero coefficients skipped, the unit ones no products, the sums in registers (with the
 * matrices as arguments, the branches on their zeros and the loads made it 5x slower).  Each output is the sum over
 * the nonzero coefficients in index order, without FMA contraction: the same values on every CPU.
 *
 * winograd_tiles: src (n, rows, cols, C) -> dst (n·th·tw, a², C), tile (i, j) reading rows i·m.. and columns
 * i·m.. of its image: the input tiles' Bᵀ d B (a x a cells each), or (`gradient`) the output gradient's A dY Aᵀ
 * (m x m cells each, src padded with zeros to whole tiles).  winograd_untile: src (n·th·tw, a², O) -> y (n, O, ho,
 * wo), each tile's Aᵀ M A cut to the output, plus the bias, then (rectify) numpy's maximum(y, 0).  The transformed
 * values lie tile by tile (the GEMMs take each position's (tiles x channels) matrix with a row stride): position by
 * position, a tile's a² values lay a whole (tiles x channels) plane apart — the same cache set for all of them when
 * the plane's bytes are a multiple of the set's span (CaffeNet's conv3 at 32 images: 4x slower). */
#define WINO_BLOCK 16
#if defined(__GNUC__)
#define CCT_ALWAYS_INLINE inline __attribute__((always_inline))
#define CCT_PREFETCH(p) __builtin_prefetch(p)
#define CCT_UNROLL _Pragma("GCC unroll 8")
#else
#define CCT_ALWAYS_INLINE inline
#define CCT_PREFETCH(p) ((void)0)
#define CCT_UNROLL
#endif
/* F(4x4, 3x3): Bᵀ (6 x 6), A (6 x 4) and Aᵀ (4 x 6); F(2x2, 3x3): Bᵀ (4 x 4), A (4 x 2), Aᵀ (2 x 4); row-major */
static const double WINO_BT4[36] = {4, 0, -5, 0, 1, 0, 0, -4, -4, 1, 1, 0, 0, 4, -4, -1, 1, 0,
                                    0, -2, -1, 2, 1, 0, 0, 2, -1, -2, 1, 0, 0, 4, 0, -5, 0, 1};
static const double WINO_A4[24] = {1, 0, 0, 0, 1, 1, 1, 1, 1, -1, 1, -1, 1, 2, 4, 8, 1, -2, 4, -8, 0, 0, 0, 1};
static const double WINO_AT4[24] = {1, 1, 1, 1, 1, 0, 0, 1, -1, 2, -2, 0, 0, 1, 1, 4, 4, 0, 0, 1, -1, 8, -8, 1};
static const double WINO_BT2[16] = {1, 0, -1, 0, 0, 1, 1, 0, 0, -1, 1, 0, 0, 1, 0, -1};
static const double WINO_A2[8] = {1, 0, 1, 1, 1, -1, 0, -1};
static const double WINO_AT2[8] = {1, 1, 1, 0, 0, 1, -1, -1};

/* y[i] = Σ_k t[i][k]·x[k] on `cb` channels (WINO_BLOCK in the main loops: a constant once inlined; fewer for the
 * channels' tail), x[k] at x0 + k·xs, y[i] at y0 + i·ys; t (ao x ai) */
#define DEFINE_WINO_LINE(NAME, T)                                                                            \
    static CCT_ALWAYS_INLINE void NAME(const T *x0, Py_ssize_t xs, T *y0, Py_ssize_t ys, const double *t,     \
                                       int ai, int ao, Py_ssize_t cb) {                                      \
        CCT_UNROLL for (int i = 0; i < ao; i++) {                                                            \
            T acc[WINO_BLOCK];                                                                               \
            for (Py_ssize_t c = 0; c < cb; c++) acc[c] = 0;                                                  \
            CCT_UNROLL for (int k = 0; k < ai; k++) {                                                        \
                const T f = (T)t[i * ai + k];                                                                \
                if (f == 0) continue;                                                                        \
                const T *x = x0 + k * xs;                                                                    \
                for (Py_ssize_t c = 0; c < cb; c++) acc[c] += f * x[c];                                      \
            }                                                                                                \
            T *y = y0 + i * ys;                                                                              \
            for (Py_ssize_t c = 0; c < cb; c++) y[c] = acc[c];                                               \
        }                                                                                                    \
    }
DEFINE_WINO_LINE(wino_line_f32, float)
DEFINE_WINO_LINE(wino_line_f64, double)

/* one tile's block of `cb` channels, the transform t (ao x ai) applied down its columns into tmp (ao x ai vectors),
 * then across into out: the tile's cell (r, c) at src + r·s_row + c·s_col, the result's (i, j) at out + i·o_row +
 * j·o_col; t a constant once inlined.  The input tiles' pass (C-vector cells of the moved input into the tile's a²
 * rows) and the output tiles' (a² product rows into an m x m block of vectors) are this with their strides. */
#define DEFINE_WINO_PASS(NAME, T, LINE)                                                                      \
    static CCT_ALWAYS_INLINE void NAME(const T *src, Py_ssize_t s_row, Py_ssize_t s_col, T *out,             \
                                       Py_ssize_t o_row, Py_ssize_t o_col, const double *t, int ai, int ao,  \
                                       Py_ssize_t cb, T *tmp) {                                              \
        for (int l = 0; l < ai; l++)                                                                         \
            LINE(src + l * s_col, s_row, tmp + l * WINO_BLOCK, ai * WINO_BLOCK, t, ai, ao, cb);              \
        for (int i = 0; i < ao; i++)                                                                         \
            LINE(tmp + i * ai * WINO_BLOCK, WINO_BLOCK, out + i * o_row, o_col, t, ai, ao, cb);              \
    }
DEFINE_WINO_PASS(wino_pass_f32, float, wino_line_f32)
DEFINE_WINO_PASS(wino_pass_f64, double, wino_line_f64)

#define DEFINE_WINO_TILES_BODY(NAME, T, PASS)                                                                \
    static CCT_ALWAYS_INLINE void NAME(const T *src, T *dst, Py_ssize_t n, Py_ssize_t rows, Py_ssize_t cols, \
                                       Py_ssize_t C, Py_ssize_t th, Py_ssize_t tw, Py_ssize_t step,          \
                                       const double *t, int ai, int ao) {                                    \
        T tmp[8 * 8 * WINO_BLOCK];                                                                           \
        const Py_ssize_t block = (Py_ssize_t)ao * ao * C;                                                    \
        for (Py_ssize_t img = 0; img < n; img++)                                                             \
            for (Py_ssize_t ti = 0; ti < th; ti++)                                                           \
                for (Py_ssize_t tj = 0; tj < tw; tj++) {                                                     \
                    const T *base = src + ((img * rows + ti * step) * cols + tj * step) * C;                 \
                    T *out = dst + ((img * th + ti) * tw + tj) * block;                                      \
                    for (Py_ssize_t c0 = 0; c0 < C; c0 += WINO_BLOCK) {                                      \
                        for (int k = 0; k < ai; k++)    /* the block after next: its cells' lines */         \
                            for (int l = 0; l < ai; l++)                                                     \
                                CCT_PREFETCH(base + (k * cols + l) * C + c0 + 2 * WINO_BLOCK);               \
                        if (C - c0 >= WINO_BLOCK)                                                            \
                            PASS(base + c0, cols * C, C, out + c0, ao * C, C, t, ai, ao, WINO_BLOCK, tmp);   \
                        else                                                                                 \
                            PASS(base + c0, cols * C, C, out + c0, ao * C, C, t, ai, ao, C - c0, tmp);       \
                    }                                                                                        \
                }                                                                                            \
    }
DEFINE_WINO_TILES_BODY(wino_tiles_body_f32, float, wino_pass_f32)
DEFINE_WINO_TILES_BODY(wino_tiles_body_f64, double, wino_pass_f64)

#define DEFINE_WINOGRAD_TILES(NAME, T, BODY)                                                                 \
    CCT_CLONES static void NAME(const T *src, T *dst, Py_ssize_t n, Py_ssize_t rows, Py_ssize_t cols,         \
                                Py_ssize_t C, Py_ssize_t th, Py_ssize_t tw, int m, int gradient) {           \
        if (m == 4 && !gradient)                                                                             \
            BODY(src, dst, n, rows, cols, C, th, tw, 4, WINO_BT4, 6, 6);                                     \
        else if (m == 4)                                                                                     \
            BODY(src, dst, n, rows, cols, C, th, tw, 4, WINO_A4, 4, 6);                                      \
        else if (!gradient)                                                                                  \
            BODY(src, dst, n, rows, cols, C, th, tw, 2, WINO_BT2, 4, 4);                                     \
        else                                                                                                 \
            BODY(src, dst, n, rows, cols, C, th, tw, 2, WINO_A2, 2, 4);                                      \
    }
DEFINE_WINOGRAD_TILES(winograd_tiles_f32, float, wino_tiles_body_f32)
DEFINE_WINOGRAD_TILES(winograd_tiles_f64, double, wino_tiles_body_f64)

/* per tile and block of output channels: the pass (M[i][j] at tile + (i·a + j)·O, t = Aᵀ) into an m x m block of
 * vectors, then each channel's cells inside the output written with the bias and the ReLU */
#define DEFINE_WINO_UNTILE_BODY(NAME, T, PASS)                                                               \
    static CCT_ALWAYS_INLINE void NAME(const T *src, T *y, const T *bias, Py_ssize_t n, Py_ssize_t O,        \
                                       Py_ssize_t ho, Py_ssize_t wo, Py_ssize_t th, Py_ssize_t tw,           \
                                       const double *t, int m, int a, int rectify) {                         \
        T tmp[8 * 8 * WINO_BLOCK], out[8 * 8 * WINO_BLOCK];                                                  \
        for (Py_ssize_t img = 0; img < n; img++)                                                             \
            for (Py_ssize_t ti = 0; ti < th; ti++)                                                           \
                for (Py_ssize_t tj = 0; tj < tw; tj++) {                                                     \
                    const T *tile = src + ((img * th + ti) * tw + tj) * a * a * O;                           \
                    const Py_ssize_t r1 = ho - ti * m < m ? ho - ti * m : m;                                 \
                    const Py_ssize_t s1 = wo - tj * m < m ? wo - tj * m : m;                                 \
                    for (Py_ssize_t o0 = 0; o0 < O; o0 += WINO_BLOCK) {                                      \
                        const Py_ssize_t ob = O - o0 < WINO_BLOCK ? O - o0 : WINO_BLOCK;                     \
                        for (int q = 0; q < a * a; q++) CCT_PREFETCH(tile + q * O + o0 + 2 * WINO_BLOCK);    \
                        if (ob == WINO_BLOCK)                                                                \
                            PASS(tile + o0, a * O, O, out, m * WINO_BLOCK, WINO_BLOCK, t, a, m, WINO_BLOCK, tmp); \
                        else                                                                                 \
                            PASS(tile + o0, a * O, O, out, m * WINO_BLOCK, WINO_BLOCK, t, a, m, ob, tmp);    \
                        for (Py_ssize_t c = 0; c < ob; c++) {                                                \
                            T *row = y + ((img * O + o0 + c) * ho + ti * m) * wo + tj * m;                   \
                            for (Py_ssize_t r = 0; r < r1; r++)                                              \
                                for (Py_ssize_t s = 0; s < s1; s++) {                                        \
                                    T v = out[(r * m + s) * WINO_BLOCK + c];                                 \
                                    if (bias) v += bias[o0 + c];                                             \
                                    row[r * wo + s] = RECTIFIED(T, v, rectify);                              \
                                }                                                                            \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
    }
DEFINE_WINO_UNTILE_BODY(wino_untile_body_f32, float, wino_pass_f32)
DEFINE_WINO_UNTILE_BODY(wino_untile_body_f64, double, wino_pass_f64)

#define DEFINE_WINOGRAD_UNTILE(NAME, T, BODY)                                                                \
    CCT_CLONES static void NAME(const T *src, T *y, const T *bias, Py_ssize_t n, Py_ssize_t O, Py_ssize_t ho,  \
                                Py_ssize_t wo, Py_ssize_t th, Py_ssize_t tw, int m, int rectify) {           \
        if (m == 4)                                                                                          \
            BODY(src, y, bias, n, O, ho, wo, th, tw, WINO_AT4, 4, 6, rectify);                               \
        else                                                                                                 \
            BODY(src, y, bias, n, O, ho, wo, th, tw, WINO_AT2, 2, 4, rectify);                               \
    }
DEFINE_WINOGRAD_UNTILE(winograd_untile_f32, float, wino_untile_body_f32)
DEFINE_WINOGRAD_UNTILE(winograd_untile_f64, double, wino_untile_body_f64)



/* ---- argument handling ------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer views[8];
    int held;
} buffers;

static void release(buffers *b) {
    for (int i = 0; i < b->held; i++) PyBuffer_Release(&b->views[i]);
    b->held = 0;
}

/* A C-contiguous buffer of at least `items` items of `itemsize` bytes (None allowed when `optional`). */
static int take(buffers *b, PyObject *obj, int writable, Py_ssize_t itemsize, Py_ssize_t items, const char *name,
                void **out, int optional) {
    if (obj == Py_None && optional) {
        *out = NULL;
        return 0;
    }
    Py_buffer *v = &b->views[b->held];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    b->held++;
    if (v->itemsize != itemsize || v->len < items * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of items of %zd", name,
                     items, itemsize, v->len, v->itemsize);
        return -1;
    }
    *out = v->buf;
    return 0;
}

/* The item size of a float32 or float64 buffer (a TypeError otherwise). */
static Py_ssize_t item_size(PyObject *obj) {
    Py_buffer probe;
    if (PyObject_GetBuffer(obj, &probe, PyBUF_C_CONTIGUOUS) < 0) return -1;
    Py_ssize_t item = probe.itemsize;
    PyBuffer_Release(&probe);
    if (item != 4 && item != 8) {
        PyErr_SetString(PyExc_TypeError, "compiled kernels take float32 or float64 data only");
        return -1;
    }
    return item;
}

/* `count` C-contiguous buffers of values of `item` bytes, each at least as long as the first: their data in `out`,
 * the first one's length returned (-1 on an error, every buffer released). */
static Py_ssize_t take_values(buffers *b, Py_ssize_t item, int count, PyObject *const *objs, const int *writable,
                              const char *const *names, void **out) {
    Py_ssize_t n = 0;
    for (int i = 0; i < count; i++) {
        if (take(b, objs[i], writable[i], item, n, names[i], &out[i], 0) < 0) {
            release(b);
            return -1;
        }
        if (i == 0) n = b->views[0].len / item;
    }
    return n;
}

/* geometry: (planes, nd, in[nd], out[nd], kernel[nd], stride[nd], pad[nd], dilation[nd]) */
static int parse_geometry(PyObject *geometry, pool_geometry *g) {
    Py_ssize_t values[2 + 6 * POOL_MAX_AXES];
    PyObject *seq = PySequence_Fast(geometry, "geometry must be a sequence of integers");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n && i < 2 + 6 * POOL_MAX_AXES; i++) {
        values[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (values[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (n < 2 || values[1] < 2 || values[1] > POOL_MAX_AXES || n != 2 + 6 * values[1]) {
        PyErr_SetString(PyExc_ValueError, "geometry: planes, nd (2 to 8), then in, out, kernel, stride, pad and "
                                          "dilation per axis");
        return -1;
    }
    g->planes = values[0];
    g->nd = values[1];
    Py_ssize_t *fields[] = {g->in, g->out, g->kernel, g->stride, g->pad, g->dilation};
    Py_ssize_t kernel_cells = 1;
    g->in_plane = g->out_plane = 1;
    for (Py_ssize_t i = 0; i < g->nd; i++) {
        for (int f = 0; f < 6; f++) fields[f][i] = values[2 + f * g->nd + i];
        if (g->in[i] < 1 || g->out[i] < 1 || g->kernel[i] < 1 || g->stride[i] < 1 || g->pad[i] < 0 ||
            g->dilation[i] < 1) {
            PyErr_SetString(PyExc_ValueError, "unsupported pooling geometry");
            return -1;
        }
        g->in_plane *= g->in[i];
        g->out_plane *= g->out[i];
        kernel_cells *= g->kernel[i];
    }
    if (g->planes < 0) {
        PyErr_SetString(PyExc_ValueError, "unsupported pooling geometry");
        return -1;
    }
    g->cells = kernel_cells;
    g->rows = g->in_plane / g->in[g->nd - 1];
    g->out_rows = g->out_plane / g->out[g->nd - 1];
    return 0;
}

/* Small planes (LeNet's 4x4 and 8x8) pooled one at a time spend their time in each plane's fixed steps (forward: a
 * split, a scan of one short vector, a cut, ~120 ns for a 4x4 plane; backward: a memset and the row indices).  Planes
 * of at most GROUP_PLANE_CELLS cells are pooled up to GROUP_CELLS input cells at a time — as many planes as divide
 * the plane count — as one plane of an extra leading axis (kernel, stride and dilation 1, no padding): the same
 * windows, offsets and winner codes, the gradient added in the same order.  Against one plane at a time on 64 x 64
 * planes (2-core Xeon, AVX-512): forward 3.1x at 4x4, 2.6x at 6x6, 1.1-1.3x at 8x8 and 10x10, 0.93-1.0x from 13x13
 * on; backward 1.5x, 1.2x, 1.04x, 0.97x, then 0.8-0.9x (more row indices per plane than a plane's fixed steps). */
#define GROUP_PLANE_CELLS 100
#define GROUP_CELLS 4096

static void group_planes(pool_geometry *g) {
    if (g->nd >= POOL_MAX_AXES || g->in_plane > GROUP_PLANE_CELLS) return;
    Py_ssize_t p = GROUP_CELLS / g->in_plane;
    if (p > g->planes) p = g->planes;
    while (p > 1 && g->planes % p) p--;
    if (p < 2) return;
    Py_ssize_t *fields[] = {g->in, g->out, g->kernel, g->stride, g->pad, g->dilation};
    const Py_ssize_t lead[] = {p, p, 1, 1, 0, 1};
    for (int f = 0; f < 6; f++) {
        memmove(fields[f] + 1, fields[f], g->nd * sizeof(Py_ssize_t));
        fields[f][0] = lead[f];
    }
    g->nd++;
    g->planes /= p;
    g->in_plane *= p;
    g->out_plane *= p;
    g->rows *= p;
    g->out_rows *= p;
}

static PyObject *max_pool_forward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *geometry, *ox, *oymax, *oy, *owin, *ocodes;
    pool_geometry g;
    buffers b = {.held = 0};
    void *x, *ymax, *y, *win, *codes;
    if (!PyArg_ParseTuple(args, "OOOOOO", &geometry, &ox, &oymax, &oy, &owin, &ocodes)) return NULL;
    if (parse_geometry(geometry, &g) < 0) return NULL;
    if (g.cells > 255) {  /* one-byte winner codes */
        PyErr_SetString(PyExc_ValueError, "unsupported MAX pooling geometry (more than 255 kernel cells)");
        return NULL;
    }
    group_planes(&g);
    Py_ssize_t item = item_size(ox);
    if (item < 0) return NULL;
    Py_ssize_t ins = g.planes * g.in_plane, outs = g.planes * g.out_plane;
    if (take(&b, ox, 0, item, ins, "x", &x, 0) < 0 || take(&b, oymax, 1, item, outs, "ymax", &ymax, 0) < 0 ||
        take(&b, oy, 1, item, outs, "y", &y, 1) < 0 || take(&b, owin, 1, 1, outs, "winners", &win, 1) < 0 ||
        take(&b, ocodes, 0, 1, g.cells, "codes", &codes, 0) < 0) {
        release(&b);
        return NULL;
    }
    pool_scan sc;
    if (scan_setup(&g, &sc) < 0) {
        release(&b);
        return PyErr_NoMemory();
    }
    Py_ssize_t phases = sc.phases;
    char *work = malloc((phases * sc.block + sc.wide) * item + sc.wide);  /* phase rows, maxima, codes */
    if (!work) {
        free(sc.phase);
        release(&b);
        return PyErr_NoMemory();
    }
    void *buf = work, *best = work + phases * sc.block * item;
    uint8_t *code = (uint8_t *)work + (phases * sc.block + sc.wide) * item;
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        max_forward_f32(&g, &sc, x, ymax, y, win, codes, buf, best, code);
    else
        max_forward_f64(&g, &sc, x, ymax, y, win, codes, buf, best, code);
    Py_END_ALLOW_THREADS
    free(work);
    free(sc.phase);
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *max_pool_backward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *geometry, *ody, *oymax, *owin, *odelta, *odx;
    int accumulate, positive;
    pool_geometry g;
    buffers b = {.held = 0};
    void *dy, *ymax, *win, *delta, *dx;
    if (!PyArg_ParseTuple(args, "OOOOOOpp", &geometry, &ody, &oymax, &owin, &odelta, &odx, &accumulate, &positive))
        return NULL;
    if (parse_geometry(geometry, &g) < 0) return NULL;
    if (g.cells > 255) {  /* one-byte winner codes */
        PyErr_SetString(PyExc_ValueError, "unsupported MAX pooling geometry (more than 255 kernel cells)");
        return NULL;
    }
    group_planes(&g);
    Py_ssize_t item = item_size(ody);
    if (item < 0) return NULL;
    Py_ssize_t ins = g.planes * g.in_plane, outs = g.planes * g.out_plane;
    if (take(&b, ody, 0, item, outs, "dy", &dy, 0) < 0 || take(&b, oymax, 0, item, outs, "ymax", &ymax, 0) < 0 ||
        take(&b, owin, 0, 1, outs, "winners", &win, 0) < 0 || take(&b, odelta, 0, 8, 256, "delta", &delta, 0) < 0 ||
        take(&b, odx, 1, item, ins, "dx", &dx, 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        max_backward_f32(&g, dy, ymax, win, delta, dx, accumulate, positive);
    else
        max_backward_f64(&g, dy, ymax, win, delta, dx, accumulate, positive);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* AVE pooling, forward (src x, table the windows' sizes, dst y) or backward (src dy, table their inverses, dst dx,
 * added with accumulate): global pooling's one window per plane by its own loops, other windows by the scan
 * (forward, small planes grouped) or the padded plane (backward). */
static PyObject *ave_pool(PyObject *args, int backward) {
    PyObject *geometry, *osrc, *otable, *odst;
    int accumulate = 0, whole;
    pool_geometry g;
    pool_scan sc = {.phase = NULL};
    ave_plan plan = {.delta = NULL};
    buffers b = {.held = 0};
    void *src, *table, *dst;
    char *work = NULL;
    if (!PyArg_ParseTuple(args, backward ? "OOOOp" : "OOOO", &geometry, &osrc, &otable, &odst, &accumulate) ||
        parse_geometry(geometry, &g) < 0)
        return NULL;
    const Py_ssize_t item = item_size(osrc), table_rows = g.out_rows, table_cells = g.out_plane;
    if (item < 0) return NULL;
    Py_ssize_t *cell = whole_plane_cells(&g, &whole);
    if (whole && !cell) return NULL;
    if (!whole && !backward) group_planes(&g);
    const Py_ssize_t ins = g.planes * g.in_plane, outs = g.planes * g.out_plane;
    if (take(&b, osrc, 0, item, backward ? outs : ins, backward ? "dy" : "x", &src, 0) < 0 ||
        take(&b, otable, 0, item, table_cells, backward ? "inv" : "size", &table, 0) < 0 ||
        take(&b, odst, 1, item, backward ? ins : outs, backward ? "dx" : "y", &dst, 0) < 0)
        goto out;
    if (!whole) {  /* forward: phase rows, then the wide grid's sums; backward: the padded plane, then gradients */
        if ((backward ? ave_plan_setup(&g, &plan) : scan_setup(&g, &sc)) < 0 ||
            !(work = malloc((backward ? plan.cells + g.out_plane : sc.phases * sc.block + sc.wide) * item))) {
            PyErr_NoMemory();
            goto out;
        }
    }
    void *second = work ? work + (backward ? plan.cells : sc.phases * sc.block) * item : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (whole && !backward)
        item == 4 ? ave_whole_f32(&g, cell, src, dst, *(float *)table)
                  : ave_whole_f64(&g, cell, src, dst, *(double *)table);
    else if (whole)
        item == 4 ? ave_whole_backward_f32(&g, cell, src, *(float *)table, dst, accumulate)
                  : ave_whole_backward_f64(&g, cell, src, *(double *)table, dst, accumulate);
    else if (!backward)
        item == 4 ? ave_forward_f32(&g, &sc, src, dst, table, table_rows, (float *)work, second)
                  : ave_forward_f64(&g, &sc, src, dst, table, table_rows, (double *)work, second);
    else
        item == 4 ? ave_backward_f32(&g, &plan, src, table, dst, accumulate, (float *)work, second)
                  : ave_backward_f64(&g, &plan, src, table, dst, accumulate, (double *)work, second);
    Py_END_ALLOW_THREADS
out:
    free(work);
    free(cell);
    free(sc.phase);
    free(plan.delta);
    release(&b);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyObject *ave_pool_forward(PyObject *self, PyObject *args) {
    (void)self;
    return ave_pool(args, 0);
}

static PyObject *ave_pool_backward(PyObject *self, PyObject *args) {
    (void)self;
    return ave_pool(args, 1);
}

static PyObject *lrn_forward(PyObject *self, PyObject *args) {
    PyObject *ox, *oscale, *oy;
    Py_ssize_t n, c, hw, size;
    double k, coeff;
    buffers b = {.held = 0};
    void *x, *scale, *y;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOnnnndd", &ox, &oscale, &oy, &n, &c, &hw, &size, &k, &coeff)) return NULL;
    Py_ssize_t item = item_size(ox), count = n * c * hw;
    if (item < 0) return NULL;
    if (take(&b, ox, 0, item, count, "x", &x, 0) < 0 || take(&b, oscale, 1, item, count, "scale", &scale, 0) < 0 ||
        take(&b, oy, 1, item, count, "y", &y, 0) < 0) {
        release(&b);
        return NULL;
    }
    void *sq = malloc((c > 0 ? c : 1) * LRN_TILE * item);
    if (!sq) {
        release(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        lrn_forward_f32(x, scale, y, n, c, hw, size, (float)k, (float)coeff, sq);
    else
        lrn_forward_f64(x, scale, y, n, c, hw, size, k, coeff, sq);
    Py_END_ALLOW_THREADS
    free(sq);
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *lrn_backward(PyObject *self, PyObject *args) {
    PyObject *ox, *oy, *ody, *oscale, *odx;
    Py_ssize_t n, c, hw, size;
    double gain;
    buffers b = {.held = 0};
    void *x, *y, *dy, *scale, *dx;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOnnnnd", &ox, &oy, &ody, &oscale, &odx, &n, &c, &hw, &size, &gain))
        return NULL;
    Py_ssize_t item = item_size(ox), count = n * c * hw;
    if (item < 0) return NULL;
    if (take(&b, ox, 0, item, count, "x", &x, 0) < 0 || take(&b, oy, 0, item, count, "y", &y, 0) < 0 ||
        take(&b, ody, 0, item, count, "dy", &dy, 0) < 0 || take(&b, oscale, 0, item, count, "scale", &scale, 0) < 0 ||
        take(&b, odx, 1, item, count, "dx", &dx, 0) < 0) {
        release(&b);
        return NULL;
    }
    void *ratio = malloc((c > 0 ? c : 1) * LRN_TILE * item);
    if (!ratio) {
        release(&b);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        lrn_backward_f32(x, y, dy, scale, dx, n, c, hw, size, (float)gain, ratio);
    else
        lrn_backward_f64(x, y, dy, scale, dx, n, c, hw, size, gain, ratio);
    Py_END_ALLOW_THREADS
    free(ratio);
    release(&b);
    Py_RETURN_NONE;
}

/* The lowering's geometry (n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow) into g; the padded extent
 * that spans the image and every window's reach into pad_h, pad_w. */
static int lowering_geometry(PyObject *geometry, Py_ssize_t *g, Py_ssize_t *pad_h, Py_ssize_t *pad_w) {
    PyObject *seq = PySequence_Fast(geometry, "geometry must be a sequence of 14 integers");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != 14) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "geometry must be a sequence of 14 integers");
        return -1;
    }
    for (int i = 0; i < 14; i++) {
        g[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (g[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    for (int i = 0; i < 14; i++)
        if (g[i] < (i == 8 || i == 9 ? 0 : 1)) {
            PyErr_SetString(PyExc_ValueError, "lowering: unsupported geometry");
            return -1;
        }
    const Py_ssize_t *k = g + 4;
    Py_ssize_t reach_h = (k[8] - 1) * k[2] + (k[0] - 1) * k[6] + 1, reach_w = (k[9] - 1) * k[3] + (k[1] - 1) * k[7] + 1;
    *pad_h = g[2] + 2 * k[4] > reach_h ? g[2] + 2 * k[4] : reach_h;
    *pad_w = g[3] + 2 * k[5] > reach_w ? g[3] + 2 * k[5] : reach_w;
    return 0;
}

/* im2col (x -> col) or, `adjoint`, col2im (col -> dx): the same arguments, checked the same way; the scratch is
 * the image split by stride phase (im2col) or one zero-padded plane (col2im); `last`: the images-innermost
 * layout, whose scratch is one zero-padded plane of every image's cells. */
static PyObject *lowering(PyObject *self, PyObject *args) {
    PyObject *oin, *oout, *geometry;
    Py_ssize_t g[14], pad_h, pad_w;
    int adjoint, last;
    buffers b = {.held = 0};
    void *in, *out;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOpp", &oin, &oout, &geometry, &adjoint, &last) ||
        lowering_geometry(geometry, g, &pad_h, &pad_w) < 0)
        return NULL;
    const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], *k = g + 4;
    const Py_ssize_t image = n * c * h * w, lowered = c * k[0] * k[1] * n * k[8] * k[9];
    Py_ssize_t item = item_size(oin);
    if (item < 0) return NULL;
    if (take(&b, oin, 0, item, adjoint ? lowered : image, adjoint ? "col" : "x", &in, 0) < 0 ||
        take(&b, oout, 1, item, adjoint ? image : lowered, adjoint ? "dx" : "col", &out, 0) < 0) {
        release(&b);
        return NULL;
    }
    const Py_ssize_t rows = adjoint || last ? pad_h : (pad_h + k[2] - 1) / k[2];
    const Py_ssize_t cols = adjoint || last ? pad_w : (pad_w + k[3] - 1) / k[3];
    /* the phase buffer (or the padded plane), then im2col's tables, 8-byte aligned */
    const Py_ssize_t data = (last ? rows * cols * n : adjoint ? rows * cols : c * k[2] * k[3] * rows * cols) * item;
    const Py_ssize_t at = (data + 7) / 8 * 8;
    char *buf = malloc(at + (adjoint || last ? 0 : (h + 2 * k[3] + k[0] * k[1]) * (Py_ssize_t)sizeof(Py_ssize_t)));
    if (!buf) {
        release(&b);
        return PyErr_NoMemory();
    }
    Py_ssize_t *table = (Py_ssize_t *)(buf + at);
    Py_BEGIN_ALLOW_THREADS
    if (adjoint && item == 4)
        col2im_f32(in, out, n, c, h, w, k, (float *)buf, rows, cols, last);
    else if (adjoint)
        col2im_f64(in, out, n, c, h, w, k, (double *)buf, rows, cols, last);
    else if (last && item == 4)
        im2col_last_f32(in, out, n, c, h, w, k, (float *)buf, rows, cols);
    else if (last)
        im2col_last_f64(in, out, n, c, h, w, k, (double *)buf, rows, cols);
    else if (item == 4)
        im2col_f32(in, out, n, c, h, w, k, (float *)buf, rows, cols, table);
    else
        im2col_f64(in, out, n, c, h, w, k, (double *)buf, rows, cols, table);
    Py_END_ALLOW_THREADS
    free(buf);
    release(&b);
    Py_RETURN_NONE;
}

/* A pass over two inputs into an output (`names`: their names in errors), the values of one float type, the output
 * writable and possibly one of the inputs. */
static PyObject *two_to_one(PyObject *args, const char *const *names,
                            void (*f32)(const float *, const float *, float *, Py_ssize_t),
                            void (*f64)(const double *, const double *, double *, Py_ssize_t)) {
    PyObject *o[3];
    void *p[3];
    buffers b = {.held = 0};
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;
    Py_ssize_t item = item_size(o[0]);
    if (item < 0) return NULL;
    Py_ssize_t n = take_values(&b, item, 3, o, (const int[]){0, 0, 1}, names, p);
    if (n < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        f32(p[0], p[1], p[2], n);
    else
        f64(p[0], p[1], p[2], n);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *add_rectified(PyObject *self, PyObject *args) {
    (void)self;
    return two_to_one(args, (const char *const[]){"a", "b", "out"}, add_rectified_f32, add_rectified_f64);
}

static PyObject *relu_backward(PyObject *self, PyObject *args) {
    (void)self;
    return two_to_one(args, (const char *const[]){"x", "dy", "dx"}, relu_backward_f32, relu_backward_f64);
}

static PyObject *all_finite(PyObject *self, PyObject *args) {
    PyObject *ox;
    buffers b = {.held = 0};
    void *x;
    (void)self;
    if (!PyArg_ParseTuple(args, "O", &ox)) return NULL;
    Py_ssize_t item = item_size(ox);
    if (item < 0) return NULL;
    const Py_ssize_t n = take_values(&b, item, 1, &ox, (const int[]){0}, (const char *const[]){"x"}, &x);
    if (n < 0) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = item == 4 ? all_finite_f32(x, n) : all_finite_f64(x, n);
    Py_END_ALLOW_THREADS
    release(&b);
    return PyBool_FromLong(ok);
}

static PyObject *transpose(PyObject *self, PyObject *args) {
    PyObject *osrc, *odst, *obias;
    Py_ssize_t rows, cols, cells;
    buffers b = {.held = 0};
    void *src, *dst, *bias;
    int rectify = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnnOn|p", &osrc, &odst, &rows, &cols, &obias, &cells, &rectify)) return NULL;
    if (rows < 0 || cols < 0 || cells < 1) {
        PyErr_SetString(PyExc_ValueError, "transpose: rows and cols must not be negative, cells positive");
        return NULL;
    }
    Py_ssize_t item = item_size(osrc);
    if (item < 0) return NULL;
    if (take(&b, osrc, 0, item, rows * cols, "src", &src, 0) < 0 ||
        take(&b, odst, 1, item, rows * cols, "dst", &dst, 0) < 0 ||
        take(&b, obias, 0, item, (rows + cells - 1) / cells, "bias", &bias, 1) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        transpose_f32(src, dst, rows, cols, bias, cells, rectify);
    else
        transpose_f64(src, dst, rows, cols, bias, cells, rectify);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *add_bias(PyObject *self, PyObject *args) {
    PyObject *oy, *obias;
    Py_ssize_t channels, cells;
    int rectify = 0;
    buffers b = {.held = 0};
    void *y, *bias;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOnn|p", &oy, &obias, &channels, &cells, &rectify)) return NULL;
    if (channels < 1 || cells < 0) {
        PyErr_SetString(PyExc_ValueError, "add_bias: channels must be positive and cells not negative");
        return NULL;
    }
    Py_ssize_t item = item_size(oy);
    if (item < 0) return NULL;
    if (take(&b, oy, 1, item, 0, "y", &y, 0) < 0 || take(&b, obias, 0, item, channels, "bias", &bias, 1) < 0) {
        release(&b);
        return NULL;
    }
    const Py_ssize_t values = b.views[0].len / item;
    if (cells == 0 || values % (channels * cells)) {
        release(&b);
        PyErr_SetString(PyExc_ValueError, "add_bias: y must hold whole images of channels x cells values");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        add_bias_f32(y, bias, values / cells, channels, cells, rectify);
    else
        add_bias_f64(y, bias, values / cells, channels, cells, rectify);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* `count` integers of a sequence, each at least 1 (a ValueError naming `what` otherwise). */
static int positive_ints(PyObject *o, Py_ssize_t *out, int count, const char *what) {
    PyObject *seq = PySequence_Fast(o, what);
    if (!seq) return -1;
    int ok = PySequence_Fast_GET_SIZE(seq) == count;
    for (int i = 0; ok && i < count; i++) {
        out[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        ok = out[i] >= 1;
    }
    Py_DECREF(seq);
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, what);
        return -1;
    }
    return 0;
}

static PyObject *winograd_tiles(PyObject *self, PyObject *args) {
    PyObject *osrc, *odst, *geometry;
    Py_ssize_t g[7];
    int gradient = 0;
    buffers b = {.held = 0};
    void *src, *dst;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO|p", &osrc, &odst, &geometry, &gradient) ||
        positive_ints(geometry, g, 7, "winograd_tiles: geometry must be 7 positive integers "
                                      "(n, rows, cols, channels, tiles_h, tiles_w, m)") < 0)
        return NULL;
    const Py_ssize_t n = g[0], rows = g[1], cols = g[2], C = g[3], th = g[4], tw = g[5], m = g[6];
    const Py_ssize_t a = m + 2, cells = gradient ? m : a;  /* a tile's cells along each axis */
    if ((m != 2 && m != 4) || (th - 1) * m + cells > rows || (tw - 1) * m + cells > cols) {
        PyErr_SetString(PyExc_ValueError, "winograd_tiles: m must be 2 or 4 and the tiles fit the source");
        return NULL;
    }
    Py_ssize_t item = item_size(osrc);
    if (item < 0) return NULL;
    if (take(&b, osrc, 0, item, n * rows * cols * C, "src", &src, 0) < 0 ||
        take(&b, odst, 1, item, n * th * tw * a * a * C, "dst", &dst, 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        winograd_tiles_f32(src, dst, n, rows, cols, C, th, tw, (int)m, gradient);
    else
        winograd_tiles_f64(src, dst, n, rows, cols, C, th, tw, (int)m, gradient);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *winograd_untile(PyObject *self, PyObject *args) {
    PyObject *osrc, *oy, *obias, *geometry;
    Py_ssize_t g[7];
    int rectify = 0;
    buffers b = {.held = 0};
    void *src, *y, *bias;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO|p", &osrc, &oy, &obias, &geometry, &rectify) ||
        positive_ints(geometry, g, 7, "winograd_untile: geometry must be 7 positive integers "
                                      "(n, channels, out_h, out_w, tiles_h, tiles_w, m)") < 0)
        return NULL;
    const Py_ssize_t n = g[0], O = g[1], ho = g[2], wo = g[3], th = g[4], tw = g[5], m = g[6], a = m + 2;
    if ((m != 2 && m != 4) || th * m < ho || tw * m < wo || (th - 1) * m >= ho || (tw - 1) * m >= wo) {
        PyErr_SetString(PyExc_ValueError, "winograd_untile: m must be 2 or 4 and the tiles cover the output exactly");
        return NULL;
    }
    Py_ssize_t item = item_size(osrc);
    if (item < 0) return NULL;
    if (take(&b, osrc, 0, item, n * th * tw * a * a * O, "src", &src, 0) < 0 ||
        take(&b, oy, 1, item, n * O * ho * wo, "y", &y, 0) < 0 || take(&b, obias, 0, item, O, "bias", &bias, 1) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        winograd_untile_f32(src, y, bias, n, O, ho, wo, th, tw, (int)m, rectify);
    else
        winograd_untile_f64(src, y, bias, n, O, ho, wo, th, tw, (int)m, rectify);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* The losses' ignore label argument: None (no label is ignored) or a number. */
static int ignore_label(PyObject *o, int *has, double *value) {
    *has = o != Py_None;
    *value = *has ? PyFloat_AsDouble(o) : 0;
    return *has && PyErr_Occurred() ? -1 : 0;
}

static PyObject *label_count(PyObject *self, PyObject *args) {
    PyObject *olabel, *oignore;
    Py_ssize_t classes;
    int has_ignore;
    double ignore;
    buffers b = {.held = 0};
    void *label;
    (void)self;
    if (!PyArg_ParseTuple(args, "OnO", &olabel, &classes, &oignore) ||
        ignore_label(oignore, &has_ignore, &ignore) < 0)
        return NULL;
    Py_ssize_t item = item_size(olabel);
    if (item < 0) return NULL;
    const Py_ssize_t n = take_values(&b, item, 1, &olabel, (const int[]){0}, (const char *const[]){"label"}, &label);
    if (n < 0) return NULL;
    Py_ssize_t count;
    Py_BEGIN_ALLOW_THREADS
    count = item == 4 ? label_count_f32(label, n, classes, has_ignore, ignore)
                      : label_count_f64(label, n, classes, has_ignore, ignore);
    Py_END_ALLOW_THREADS
    release(&b);
    return PyLong_FromSsize_t(count);
}

static PyObject *softmax_loss_backward(PyObject *self, PyObject *args) {
    PyObject *op, *olabel, *odx, *oignore;
    Py_ssize_t outer, classes, inner;
    double scale, ignore;
    int has_ignore;
    buffers b = {.held = 0};
    void *p, *label, *dx;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO(nnn)dO", &op, &olabel, &odx, &outer, &classes, &inner, &scale, &oignore) ||
        ignore_label(oignore, &has_ignore, &ignore) < 0)
        return NULL;
    Py_ssize_t item = item_size(op);
    if (item < 0) return NULL;
    if (take(&b, op, 0, item, outer * classes * inner, "p", &p, 0) < 0 ||
        take(&b, olabel, 0, item, outer * inner, "label", &label, 0) < 0 ||
        take(&b, odx, 1, item, outer * classes * inner, "dx", &dx, 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        softmax_loss_backward_f32(p, label, dx, outer, classes, inner, (float)scale, has_ignore, ignore);
    else
        softmax_loss_backward_f64(p, label, dx, outer, classes, inner, scale, has_ignore, ignore);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* depthwise(which, src, other, dst, bias, geometry, first, last): which 0, the forward: src x, other the weights,
 * dst y, its planes [first, last) overwritten — (output channel, image) where small planes are stacked, else
 * (image, output channel) —, bias None or O values; 1, the data gradient: src dy, other the weights, dst dx, its
 * planes (input channel, image), or (image, input channel), [first, last) overwritten; 2, the
 * weight gradient: src x, other dy, dst dw, output channels [first, last) accumulated.  geometry: n, c, o, h, w,
 * kh, kw, sh, sw, ph, pw, dh, dw, oh, ow (o a multiple of c, at most DW_MAX_FAN times; kernel and stride at most
 * DW_MAX_K per axis). */
/* The 15 geometry values of depthwise() and depthwise_backward() into g, checked; 1 where they are a geometry
 * the kernels take, 0 where not, -1 with an exception set where they are not integers. */
static int dw_geometry(PyObject *geometry, Py_ssize_t *g) {
    PyObject *seq = PySequence_Fast(geometry, "geometry must be a sequence of 15 integers");
    if (!seq) return -1;
    int bad = PySequence_Fast_GET_SIZE(seq) != 15;
    for (int i = 0; !bad && i < 15; i++) {
        g[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        bad = g[i] == -1 && PyErr_Occurred() ? -1 : g[i] < (i == 9 || i == 10 ? 0 : 1);
    }
    Py_DECREF(seq);
    if (bad < 0) return -1;
    return !(bad || g[2] % g[1] || g[2] / g[1] > DW_MAX_FAN || g[5] > DW_MAX_K || g[6] > DW_MAX_K ||
             g[7] > DW_MAX_K || g[8] > DW_MAX_K ||
             g[3] + 2 * g[9] < g[11] * (g[5] - 1) + 1 || g[4] + 2 * g[10] < g[12] * (g[6] - 1) + 1 ||
             g[13] != (g[3] + 2 * g[9] - (g[11] * (g[5] - 1) + 1)) / g[7] + 1 ||
             g[14] != (g[4] + 2 * g[10] - (g[12] * (g[6] - 1) + 1)) / g[8] + 1);
}

static PyObject *depthwise(PyObject *self, PyObject *args) {
    PyObject *osrc, *oother, *odst, *obias, *geometry;
    int which;
    Py_ssize_t g[15], first, last;
    buffers b = {.held = 0};
    void *src, *other, *dst, *bias;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOOOOOnn", &which, &osrc, &oother, &odst, &obias, &geometry, &first, &last))
        return NULL;
    const int ok = dw_geometry(geometry, g);
    if (ok < 0) return NULL;
    if (!ok || which < 0 || which > 2 || first < 0 || first > last ||
        last > (which == 0 ? g[0] * g[2] : which == 1 ? g[0] * g[1] : g[2])) {
        PyErr_SetString(PyExc_ValueError, "depthwise: unsupported geometry");
        return NULL;
    }
    const Py_ssize_t images = g[0] * g[1] * g[3] * g[4], outputs = g[0] * g[2] * g[13] * g[14],
                     weights = g[2] * g[5] * g[6], phases = g[7] * g[8], taps = g[5] * g[6];
    Py_ssize_t item = item_size(osrc);
    if (item < 0) return NULL;
    const char *names[3][3] = {{"x", "w", "y"}, {"dy", "w", "dx"}, {"x", "dy", "dw"}};
    const Py_ssize_t sizes[3][3] = {{images, weights, outputs}, {outputs, weights, images}, {images, outputs, weights}};
    if (take(&b, osrc, 0, item, sizes[which][0], names[which][0], &src, 0) < 0 ||
        take(&b, oother, 0, item, sizes[which][1], names[which][1], &other, 0) < 0 ||
        take(&b, odst, 1, item, sizes[which][2], names[which][2], &dst, 0) < 0 ||
        take(&b, which == 0 ? obias : Py_None, 0, item, g[2], "bias", &bias, 1) < 0) {
        release(&b);
        return NULL;
    }
    /* the plan, then the scratch: the zero-bordered buffers (the input's phases, or the group's output gradients),
     * the wide output (or the gradient's wide rows), the weight gradient's lanes (64-byte aligned) */
    dw_layout l;
    dw_pass *passes = malloc(sizeof(dw_pass) * (which == 1 ? phases : 1));
    char *scratch = NULL;
    Py_ssize_t at_wide = 0, at_lanes = 0;
    if (passes) {
        if (which == 1)
            dw_plan_data(&l, passes, g);
        else
            dw_plan_forward(&l, passes, g);
        at_wide = (which == 1 ? g[2] / g[1] : phases) * l.len * item;
        at_lanes = (at_wide + (l.cells + DW_WIDE) * item + 63) / 64 * 64;
        scratch = aligned_alloc(64, (at_lanes + (which == 2 ? taps * (DW_BLOCK * item + 8) : 0) + 127) / 64 * 64);
        if (scratch) memset(scratch, 0, at_lanes);
    }
    if (!passes || !scratch) {
        free(passes);
        free(scratch);
        release(&b);
        return PyErr_NoMemory();
    }
    void *wide = scratch + at_wide, *lanes = scratch + at_lanes;
    double *acc = (double *)(scratch + at_lanes + taps * DW_BLOCK * item);
    Py_BEGIN_ALLOW_THREADS
    if (which == 0 && item == 4)
        depthwise_f32_forward(src, other, bias, dst, g, &l, passes, first, last, (float *)scratch, wide);
    else if (which == 0)
        depthwise_f64_forward(src, other, bias, dst, g, &l, passes, first, last, (double *)scratch, wide);
    else if (which == 1 && item == 4)
        depthwise_f32_data(src, other, dst, g, &l, passes, first, last, (float *)scratch, wide);
    else if (which == 1)
        depthwise_f64_data(src, other, dst, g, &l, passes, first, last, (double *)scratch, wide);
    else if (item == 4)
        depthwise_f32_weights(src, other, dst, g, &l, passes, first, last, (float *)scratch, wide, lanes, acc);
    else
        depthwise_f64_weights(src, other, dst, g, &l, passes, first, last, (double *)scratch, wide, lanes, acc);
    Py_END_ALLOW_THREADS
    free(scratch);
    free(passes);
    release(&b);
    Py_RETURN_NONE;
}

/* depthwise_backward(x, dy, w, dx, dw, geometry, first, last): both gradients of input channels [first, last) in
 * one pass over each channel's planes — dx's planes overwritten, dw accumulated — where the layer has one output
 * per input channel, stride 1, planes too large to stack, and its forward and data-gradient layouts coincide (dy
 * then lies in the data gradient's buffer as the weight gradient reads it: the bits of depthwise() 1 and 2): dy
 * read from memory once, 12-14% faster on MobileNet's 112x112 to 28x28 layers (stacked small planes measured
 * 6-37% slower so: their products read dy at an offset across cache lines); True, or False with nothing computed
 * where that does not hold (first == last asks without computing).  Geometry as depthwise()'s. */
static PyObject *depthwise_backward(PyObject *self, PyObject *args) {
    PyObject *o[5], *geometry;
    Py_ssize_t g[15], first, last;
    buffers b = {.held = 0};
    void *p[5];
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOnn", &o[0], &o[1], &o[2], &o[3], &o[4], &geometry, &first, &last))
        return NULL;
    const int ok = dw_geometry(geometry, g);
    if (ok < 0) return NULL;
    if (!ok || first < 0 || first > last || last > g[1]) {
        PyErr_SetString(PyExc_ValueError, "depthwise_backward: unsupported geometry");
        return NULL;
    }
    dw_layout lf, ld;
    dw_pass pf, pd;
    if (g[2] != g[1] || g[7] != 1 || g[8] != 1) Py_RETURN_FALSE;
    dw_plan_forward(&lf, &pf, g);
    dw_plan_data(&ld, &pd, g);
    if (lf.pitch != ld.pitch || lf.span != ld.span || lf.images != 1 || ld.images != 1) Py_RETURN_FALSE;
    if (first == last) Py_RETURN_TRUE;
    const Py_ssize_t images = g[0] * g[1] * g[3] * g[4], outputs = g[0] * g[2] * g[13] * g[14],
                     weights = g[2] * g[5] * g[6], taps = g[5] * g[6];
    Py_ssize_t item = item_size(o[0]);
    if (item < 0) return NULL;
    const char *names[5] = {"x", "dy", "w", "dx", "dw"};
    const Py_ssize_t sizes[5] = {images, outputs, weights, images, weights};
    for (int i = 0; i < 5; i++)
        if (take(&b, o[i], i >= 3, item, sizes[i], names[i], &p[i], 0) < 0) {
            release(&b);
            return NULL;
        }
    /* scratch: x's buffer, dy's, the data pass's wide output, the weight gradient's lanes (64-byte aligned) */
    const Py_ssize_t at_dbuf = lf.len * item, at_wide = at_dbuf + ld.len * item,
                     at_lanes = (at_wide + (ld.cells + DW_WIDE) * item + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, (at_lanes + taps * (DW_BLOCK * item + 8) + 127) / 64 * 64);
    if (!scratch) {
        release(&b);
        return PyErr_NoMemory();
    }
    memset(scratch, 0, at_lanes);
    void *dbuf = scratch + at_dbuf, *wide = scratch + at_wide, *lanes = scratch + at_lanes;
    double *acc = (double *)(scratch + at_lanes + taps * DW_BLOCK * item);
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        depthwise_f32_both(p[0], p[1], p[2], p[3], p[4], g, &lf, &pf, &ld, &pd, first, last, (float *)scratch, dbuf,
                           wide, lanes, acc);
    else
        depthwise_f64_both(p[0], p[1], p[2], p[3], p[4], g, &lf, &pf, &ld, &pd, first, last, (double *)scratch,
                           dbuf, wide, lanes, acc);
    Py_END_ALLOW_THREADS
    free(scratch);
    release(&b);
    Py_RETURN_TRUE;
}

static PyObject *sgd_update(PyObject *self, PyObject *args) {
    PyObject *o[3];
    void *p[3];
    int normalize, l1;
    double norm, decay, rate, momentum;
    buffers b = {.held = 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOpddpdd", &o[0], &o[1], &o[2], &normalize, &norm, &decay, &l1, &rate, &momentum))
        return NULL;
    Py_ssize_t item = item_size(o[0]);
    if (item < 0) return NULL;
    Py_ssize_t n = take_values(&b, item, 3, o, (const int[]){1, 1, 1}, (const char *const[]){"w", "g", "h"}, p);
    if (n < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        sgd_f32(p[0], p[1], p[2], n, normalize, (float)norm, (float)decay, l1, (float)rate, (float)momentum);
    else
        sgd_f64(p[0], p[1], p[2], n, normalize, norm, decay, l1, rate, momentum);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* ---- per-channel rows: argument handling ----------------------------------------------------------------- */
/* The values' buffer `obj` (its item size and length: rows = length / cells), with `cells` > 0. */
static Py_ssize_t take_rows(buffers *b, PyObject *obj, int writable, Py_ssize_t cells, const char *name,
                            Py_ssize_t *item, void **out) {
    if (cells <= 0) {
        PyErr_SetString(PyExc_ValueError, "cells must be positive");
        return -1;
    }
    *item = item_size(obj);
    if (*item < 0 || take(b, obj, writable, *item, 0, name, out, 0) < 0) return -1;
    Py_ssize_t n = b->views[b->held - 1].len / *item;
    if (n % cells) {
        PyErr_Format(PyExc_ValueError, "%s: %zd values are not rows of %zd cells", name, n, cells);
        return -1;
    }
    return n / cells;
}

static PyObject *row_moments(PyObject *self, PyObject *args) {
    PyObject *o[3];
    void *p[3];
    Py_ssize_t cells, item, rows;
    buffers b = {.held = 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOn", &o[0], &o[1], &o[2], &cells)) return NULL;
    if ((rows = take_rows(&b, o[0], 0, cells, "x", &item, &p[0])) < 0 ||
        take(&b, o[1], 1, item, rows, "mean", &p[1], 0) < 0 || take(&b, o[2], 1, item, rows, "m2", &p[2], 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        row_moments_f32(p[0], p[1], p[2], rows, cells);
    else
        row_moments_f64(p[0], p[1], p[2], rows, cells);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *row_sums(PyObject *self, PyObject *args) {
    PyObject *o[4];
    void *p[4];
    Py_ssize_t cells, item, rows;
    buffers b = {.held = 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOn", &o[0], &o[1], &o[2], &o[3], &cells)) return NULL;
    if ((rows = take_rows(&b, o[0], 0, cells, "a", &item, &p[0])) < 0 ||
        take(&b, o[1], 0, item, rows * cells, "b", &p[1], 1) < 0 ||
        take(&b, o[2], 1, item, rows, "sums", &p[2], 0) < 0 ||
        take(&b, o[3], 1, item, p[1] ? rows : 0, "dots", &p[3], 1) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        row_sums_f32(p[0], p[1], p[2], p[3], rows, cells);
    else
        row_sums_f64(p[0], p[1], p[2], p[3], rows, cells);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* normalize_rows and scale_rows: (x, vector or None, vector [or None], out, second output or None, cells) with
 * the per-channel vectors' common length as the channel count. */
static PyObject *channel_rows(PyObject *args, int scaling) {
    PyObject *o[5];
    void *p[5];
    Py_ssize_t cells, item, rows;
    buffers b = {.held = 0};
    if (!PyArg_ParseTuple(args, "OOOOOn", &o[0], &o[1], &o[2], &o[3], &o[4], &cells)) return NULL;
    if ((rows = take_rows(&b, o[0], 0, cells, "x", &item, &p[0])) < 0 ||
        take(&b, o[scaling ? 1 : 2], 0, item, 1, scaling ? "scale" : "std", &p[scaling ? 1 : 2], 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_ssize_t channels = b.views[1].len / item;
    if (take(&b, o[scaling ? 2 : 1], 0, item, channels, scaling ? "bias" : "mean", &p[scaling ? 2 : 1], 1) < 0 ||
        take(&b, o[3], 1, item, rows * cells, "out", &p[3], 0) < 0 ||
        take(&b, o[4], 1, item, rows * cells, scaling ? "save" : "copy", &p[4], 1) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (scaling && item == 4)
        scale_rows_f32(p[0], p[1], p[2], p[3], p[4], rows, channels, cells);
    else if (scaling)
        scale_rows_f64(p[0], p[1], p[2], p[3], p[4], rows, channels, cells);
    else if (item == 4)
        normalize_rows_f32(p[0], p[1], p[2], p[3], p[4], rows, channels, cells);
    else
        normalize_rows_f64(p[0], p[1], p[2], p[3], p[4], rows, channels, cells);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

static PyObject *normalize_rows(PyObject *self, PyObject *args) {
    (void)self;
    return channel_rows(args, 0);
}

static PyObject *scale_rows(PyObject *self, PyObject *args) {
    (void)self;
    return channel_rows(args, 1);
}

static PyObject *normalize_backward_rows(PyObject *self, PyObject *args) {
    PyObject *o[6];
    void *p[6];
    Py_ssize_t cells, item, rows;
    buffers b = {.held = 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOn", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &cells)) return NULL;
    if ((rows = take_rows(&b, o[0], 0, cells, "dy", &item, &p[0])) < 0 ||
        take(&b, o[1], 0, item, rows * cells, "y", &p[1], 0) < 0 || take(&b, o[4], 0, item, 1, "std", &p[4], 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_ssize_t channels = b.views[2].len / item;
    if (take(&b, o[2], 0, item, channels, "a", &p[2], 0) < 0 || take(&b, o[3], 0, item, channels, "b", &p[3], 0) < 0 ||
        take(&b, o[5], 1, item, rows * cells, "out", &p[5], 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        normalize_backward_rows_f32(p[0], p[1], p[2], p[3], p[4], p[5], rows, channels, cells);
    else
        normalize_backward_rows_f64(p[0], p[1], p[2], p[3], p[4], p[5], rows, channels, cells);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* The per-channel vector `obj` (required unless `optional`): `channels` items, or (channels == 0) any length, which
 * then sets `channels`. */
static int take_channels(buffers *b, PyObject *obj, Py_ssize_t item, Py_ssize_t *channels, const char *name,
                         void **out, int optional) {
    if (take(b, obj, 0, item, *channels ? *channels : 1, name, out, optional) < 0) return -1;
    if (*out && !*channels) *channels = b->views[b->held - 1].len / item;
    return 0;
}

static PyObject *normalize_scale_rows(PyObject *self, PyObject *args) {
    PyObject *o[7];
    void *p[7];
    Py_ssize_t cells, item, rows, channels = 0;
    int rectify = 0;
    buffers b = {.held = 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOn|p", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &cells, &rectify))
        return NULL;
    if ((rows = take_rows(&b, o[0], 0, cells, "x", &item, &p[0])) < 0 ||
        take_channels(&b, o[2], item, &channels, "std", &p[2], 0) < 0 ||
        take_channels(&b, o[1], item, &channels, "mean", &p[1], 1) < 0 ||
        take_channels(&b, o[3], item, &channels, "scale", &p[3], 0) < 0 ||
        take_channels(&b, o[4], item, &channels, "bias", &p[4], 1) < 0 ||
        take(&b, o[5], 1, item, rows * cells, "out", &p[5], 0) < 0 ||
        take(&b, o[6], 1, item, rows * cells, "copy", &p[6], 0) < 0) {
        release(&b);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (item == 4)
        normalize_scale_rows_f32(p[0], p[1], p[2], p[3], p[4], p[5], p[6], rows, channels, cells, rectify);
    else
        normalize_scale_rows_f64(p[0], p[1], p[2], p[3], p[4], p[5], p[6], rows, channels, cells, rectify);
    Py_END_ALLOW_THREADS
    release(&b);
    Py_RETURN_NONE;
}

/* ---- out += a @ b through numpy's own BLAS --------------------------------------------------------------
 * cct.engines.gemm finds the cblas ?gemm numpy is linked against and gives its address here once (set_gemm);
 * gemm_accumulate then makes the call numpy has no form for (beta = 1) from 2-D views as they lie — unit-strided
 * along rows or along columns, as the BLAS takes them transposed or not — with the GIL released, in one C call
 * (the ctypes call with its argument checks in Python held the GIL ~4 us longer, a partition thread's turn). */
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t, const float *,
                          int32_t, float, float *, int32_t);
typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t, const float *,
                          int64_t, float, float *, int64_t);
typedef void (*dgemm32_t)(int, int, int, int32_t, int32_t, int32_t, double, const double *, int32_t,
                          const double *, int32_t, double, double *, int32_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double, const double *, int64_t,
                          const double *, int64_t, double, double *, int64_t);
static void *gemm_fn[2];   /* float32, float64 */
static int gemm_ilp64[2];  /* the BLAS's integers are 64-bit */

static PyObject *set_gemm(PyObject *self, PyObject *args) {
    unsigned long long address;
    int item, ilp64;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKp", &item, &address, &ilp64)) return NULL;
    if (item != 4 && item != 8) {
        PyErr_SetString(PyExc_ValueError, "set_gemm: item size must be 4 or 8");
        return NULL;
    }
    gemm_fn[item == 8] = (void *)(uintptr_t)address;
    gemm_ilp64[item == 8] = ilp64;
    Py_RETURN_NONE;
}

/* (transpose flag, leading dimension) of a 2-D view unit-strided along its rows or its columns; 0 if neither. */
static int gemm_operand(const Py_buffer *v, int *trans, Py_ssize_t *ld) {
    const Py_ssize_t rows = v->shape[0], cols = v->shape[1], s0 = v->strides[0], s1 = v->strides[1];
    const Py_ssize_t item = v->itemsize;
    if ((s1 == item || cols == 1) && s0 > 0 && s0 % item == 0 && s0 / item >= (cols > 1 ? cols : 1)) {
        *trans = CBLAS_NO_TRANS;
        *ld = s0 / item;
        return 1;
    }
    if ((s0 == item || rows == 1) && s1 > 0 && s1 % item == 0 && s1 / item >= (rows > 1 ? rows : 1)) {
        *trans = CBLAS_TRANS;
        *ld = s1 / item;
        return 1;
    }
    return 0;
}

static PyObject *gemm_accumulate(PyObject *self, PyObject *args) {
    PyObject *o[3];
    Py_buffer v[3];
    int held = 0, done = 0, trans[3] = {0, 0, 0};
    Py_ssize_t ld[3] = {0, 0, 0};
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO", &o[0], &o[1], &o[2])) return NULL;  /* out, a, b */
    for (; held < 3; held++)
        if (PyObject_GetBuffer(o[held], &v[held], PyBUF_STRIDES | PyBUF_FORMAT | (held ? 0 : PyBUF_WRITABLE)) < 0)
            goto out;
    const Py_ssize_t item = v[0].itemsize;
    void *fn = (item == 4 || item == 8) ? gemm_fn[item == 8] : NULL;
    int same = fn != NULL;
    for (int i = 0; i < 3 && same; i++)  /* native float32 or float64, all three alike */
        same = v[i].ndim == 2 && v[i].itemsize == item && v[i].format &&
               strcmp(v[i].format, item == 4 ? "f" : "d") == 0 && gemm_operand(&v[i], &trans[i], &ld[i]);
    if (!same || trans[0] != CBLAS_NO_TRANS || v[1].shape[1] != v[2].shape[0] || v[0].shape[0] != v[1].shape[0] ||
        v[0].shape[1] != v[2].shape[1]) {
        done = 0;
        goto out;
    }
    const Py_ssize_t m = v[1].shape[0], k = v[1].shape[1], n = v[2].shape[1];
    const int ilp64 = gemm_ilp64[item == 8];
    if (!ilp64 && (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || ld[0] > INT32_MAX || ld[1] > INT32_MAX ||
                   ld[2] > INT32_MAX)) {
        done = 0;
        goto out;
    }
    done = 1;
    if (m && n && k) {
        Py_BEGIN_ALLOW_THREADS
        if (item == 4 && ilp64)
            ((sgemm64_t)fn)(CBLAS_ROW_MAJOR, trans[1], trans[2], m, n, k, 1.0f, v[1].buf, ld[1], v[2].buf, ld[2], 1.0f,
                            v[0].buf, ld[0]);
        else if (item == 4)
            ((sgemm32_t)fn)(CBLAS_ROW_MAJOR, trans[1], trans[2], (int32_t)m, (int32_t)n, (int32_t)k, 1.0f, v[1].buf,
                            (int32_t)ld[1], v[2].buf, (int32_t)ld[2], 1.0f, v[0].buf, (int32_t)ld[0]);
        else if (ilp64)
            ((dgemm64_t)fn)(CBLAS_ROW_MAJOR, trans[1], trans[2], m, n, k, 1.0, v[1].buf, ld[1], v[2].buf, ld[2], 1.0,
                            v[0].buf, ld[0]);
        else
            ((dgemm32_t)fn)(CBLAS_ROW_MAJOR, trans[1], trans[2], (int32_t)m, (int32_t)n, (int32_t)k, 1.0, v[1].buf,
                            (int32_t)ld[1], v[2].buf, (int32_t)ld[2], 1.0, v[0].buf, (int32_t)ld[0]);
        Py_END_ALLOW_THREADS
    }
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    if (held < 3) return NULL;
    return PyBool_FromLong(done);
}

/* A float32 GEMM of its own for the products OpenBLAS runs well below its peak: y = w @ x (+ bias per row) with
 * few rows (the output channels), a moderate inner dimension and many columns — a type-1 lowering's per-image
 * product (CaffeNet's conv1: 96 x 363 by 363 x 3025, at 62-70% of OpenBLAS's 2048³ rate on this product with
 * AVX-512 kernels; OpenBLAS packs both operands of every call in its general blocking).  Here w is packed once
 * per call into blocks of 12 rows, [block][k][12]; x, a block of up to 8 panels of 32 columns at a time, into
 * [panel][k][32] (one aligned 32-value move per row and panel, its last panel's missing columns zero); each 12 x 32
 * tile of y is then a set of vector accumulators over the whole inner dimension (no partial sums written back).
 * Every value is a sum over k in order, one fused multiply-add at a time, wherever its tile lies: the same bits
 * for any split of the columns.  Built twice over the same packed operands, chosen at run time by the vector width
 * in use (vector_width()): AVX-512F, a tile as 24 accumulators (a row of x's panel two vector loads and each of
 * w's 12 values one broadcast for 24 fused multiply-adds), and AVX2 with FMA, a tile as four 6 x 16 blocks of 12
 * accumulators each — the same operations on every value, so the same bits.  Elsewhere (no FMA, not x86-64) the
 * caller keeps its BLAS call. */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define PANEL_ROWS 12
#define PANEL_COLS 32
#define PANEL_BLOCK_BYTES (512 << 10) /* the packed panels of one block of columns: in the core's L2 cache */
#define PANEL_TARGET_512 __attribute__((target("avx512f")))
#define PANEL_TARGET_256 __attribute__((target("avx2,fma")))
/* What a tile does with its sums as it stores them (a mode's bits): add them to y's values (PANEL_LOAD), and, after
 * the bias, numpy's maximum(., 0) — NaN kept, -0.0 to +0 — for an in-place ReLU after the convolution
 * (PANEL_RECTIFY: the bits of the ReLU's own pass). */
#define PANEL_LOAD 1
#define PANEL_RECTIFY 2

/* The panel kernels for the vector width in use: 64 (AVX-512F), 32 (AVX2 and FMA) or 0 (none here). */
static int panel_width(void) {
    const int bytes = vector_bytes();
    return bytes == 64 ? 64 : bytes == 32 && __builtin_cpu_supports("fma") ? 32 : 0;
}

/* The store masks of a tile whose panel has `left` live columns (32 or more: all). */
static inline void panel_masks(Py_ssize_t left, __mmask16 *m0, __mmask16 *m1) {
    *m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    *m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
}

/* y[r][c] (= or, with `load`, +=) Σ_i a[i][r] · p[i][c] (+ bias[r]) for r < rows, c < live: one tile, a's values
 * PANEL_ROWS apart per i, p's PANEL_COLS (rows past `rows` and columns past `live` computed, not stored). */
PANEL_TARGET_512 static inline __m512 panel_rectified_512(__m512 v) {
    return _mm512_mask_mov_ps(_mm512_max_ps(v, _mm512_setzero_ps()), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

PANEL_TARGET_512 static void panel_tile_512(const float *a, const float *p, Py_ssize_t k, float *y, Py_ssize_t ldy,
                                            int rows, Py_ssize_t live, const float *bias, int mode) {
    __mmask16 m0, m1;
    panel_masks(live, &m0, &m1);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0, a10 = a0, a11 = a0;
    __m512 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0, b8 = a0, b9 = a0, b10 = a0,
           b11 = a0;
    for (Py_ssize_t i = 0; i < k; i++) {
        const __m512 x0 = _mm512_load_ps(p), x1 = _mm512_load_ps(p + 16);
        __m512 v;
#define PANEL_ROW(r)                                                                                          \
    v = _mm512_set1_ps(a[r]);                                                                                 \
    a##r = _mm512_fmadd_ps(v, x0, a##r);                                                                      \
    b##r = _mm512_fmadd_ps(v, x1, b##r);
        PANEL_ROW(0) PANEL_ROW(1) PANEL_ROW(2) PANEL_ROW(3) PANEL_ROW(4) PANEL_ROW(5)
        PANEL_ROW(6) PANEL_ROW(7) PANEL_ROW(8) PANEL_ROW(9) PANEL_ROW(10) PANEL_ROW(11)
#undef PANEL_ROW
        p += PANEL_COLS;
        a += PANEL_ROWS;
    }
    /* the rows of y the tile covers, straight from the accumulators */
#define PANEL_STORE(r)                                                                                        \
    if (r < rows) {                                                                                           \
        if (mode & PANEL_LOAD) {                                                                              \
            a##r = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, y + r * ldy), a##r);                               \
            b##r = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, y + r * ldy + 16), b##r);                          \
        }                                                                                                     \
        if (bias) {                                                                                           \
            a##r = _mm512_add_ps(a##r, _mm512_set1_ps(bias[r]));                                              \
            b##r = _mm512_add_ps(b##r, _mm512_set1_ps(bias[r]));                                              \
        }                                                                                                     \
        if (mode & PANEL_RECTIFY) {                                                                           \
            a##r = panel_rectified_512(a##r);                                                                 \
            b##r = panel_rectified_512(b##r);                                                                 \
        }                                                                                                     \
        _mm512_mask_storeu_ps(y + r * ldy, m0, a##r);                                                         \
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, b##r);                                                    \
    }
    PANEL_STORE(0) PANEL_STORE(1) PANEL_STORE(2) PANEL_STORE(3) PANEL_STORE(4) PANEL_STORE(5)
    PANEL_STORE(6) PANEL_STORE(7) PANEL_STORE(8) PANEL_STORE(9) PANEL_STORE(10) PANEL_STORE(11)
#undef PANEL_STORE
}

/* `count` (at most 16) values from src to dst. */
PANEL_TARGET_512 static inline void panel_move_512(float *dst, const float *src, Py_ssize_t count) {
    const __mmask16 mask = (__mmask16)((1u << count) - 1);
    _mm512_mask_storeu_ps(dst, mask, _mm512_maskz_loadu_ps(mask, src));
}

/* A panel row: `live` (at most 32) values from `from`, zeros after them (`to` 64-byte aligned). */
PANEL_TARGET_512 static inline void panel_row_512(float *to, const float *from, Py_ssize_t live) {
    __mmask16 m0, m1;
    panel_masks(live, &m0, &m1);  /* masked loads read nothing past the row */
    _mm512_store_ps(to, _mm512_maskz_loadu_ps(m0, from));
    _mm512_store_ps(to + 16, _mm512_maskz_loadu_ps(m1, from + 16));
}

/* r[j] = column j of the 16 x 16 matrix whose row i is r[i]: values paired within 128-bit lanes, 4 x 4 blocks
 * gathered within lanes, then the lanes moved in two steps. */
PANEL_TARGET_512 static inline void panel_transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {  /* r[4i + j], lane L: column 4L + j of rows 4i..4i+3 */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {  /* lanes 0, 2 and 1, 3 of rows 0-7 and of rows 8-15 */
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
    }
}

/* The `rows` (at most 12) rows of dy from `from` (cols apart) over `span` positions into [position][12] at `to`,
 * rows past them zeros: 16 positions at a time, transposed in registers. */
PANEL_TARGET_512 static void panel_pack_dy_512(const float *from, Py_ssize_t cols, Py_ssize_t rows, float *to,
                                               Py_ssize_t span) {
    for (Py_ssize_t t0 = 0; t0 < span; t0 += 16) {
        const Py_ssize_t count = span - t0 < 16 ? span - t0 : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 r[16];
        for (int i = 0; i < 16; i++)
            r[i] = i < rows ? _mm512_maskz_loadu_ps(mask, from + i * cols + t0) : _mm512_setzero_ps();
        panel_transpose16(r);
        for (Py_ssize_t t = 0; t < count; t++)
            _mm512_mask_storeu_ps(to + (t0 + t) * PANEL_ROWS, (1u << PANEL_ROWS) - 1, r[t]);
    }
}

/* lanes[8 - n ..]: the mask of the first n of 8 lanes */
static const int32_t panel_lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

PANEL_TARGET_256 static inline __m256i panel_mask8(Py_ssize_t n) {
    return _mm256_loadu_si256((const __m256i *)(panel_lanes + 8 - (n < 0 ? 0 : n > 8 ? 8 : n)));
}

/* panel_tile_512's tile as four blocks of 6 rows by 16 columns (12 accumulators, two loads and a broadcast: the
 * 16 registers), each value the same fused multiply-adds, addition of y and bias in the same order. */
PANEL_TARGET_256 static inline __m256 panel_rectified_256(__m256 v) {
    return _mm256_blendv_ps(_mm256_max_ps(v, _mm256_setzero_ps()), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

PANEL_TARGET_256 static void panel_tile_256(const float *a, const float *p, Py_ssize_t k, float *y, Py_ssize_t ldy,
                                            int rows, Py_ssize_t live, const float *bias, int mode) {
    for (int half = 0; half < 2 && live > 16 * half; half++) {
        const Py_ssize_t cols = live - 16 * half;  /* this half's live columns */
        const __m256i k0 = panel_mask8(cols), k1 = panel_mask8(cols - 8);
        for (int r0 = 0; r0 < rows; r0 += 6) {
            const float *pp = p + 16 * half, *aa = a + r0;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
            __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;
            for (Py_ssize_t i = 0; i < k; i++) {
                const __m256 x0 = _mm256_load_ps(pp), x1 = _mm256_load_ps(pp + 8);
                __m256 v;
#define PANEL_ROW(r)                                                                                          \
    v = _mm256_broadcast_ss(aa + r);                                                                          \
    a##r = _mm256_fmadd_ps(v, x0, a##r);                                                                      \
    b##r = _mm256_fmadd_ps(v, x1, b##r);
                PANEL_ROW(0) PANEL_ROW(1) PANEL_ROW(2) PANEL_ROW(3) PANEL_ROW(4) PANEL_ROW(5)
#undef PANEL_ROW
                pp += PANEL_COLS;
                aa += PANEL_ROWS;
            }
#define PANEL_STORE(r)                                                                                        \
    if (r0 + r < rows) {                                                                                      \
        float *yr = y + (r0 + r) * ldy + 16 * half;                                                           \
        if (mode & PANEL_LOAD) {                                                                              \
            a##r = _mm256_add_ps(_mm256_maskload_ps(yr, k0), a##r);                                           \
            b##r = _mm256_add_ps(_mm256_maskload_ps(yr + 8, k1), b##r);                                       \
        }                                                                                                     \
        if (bias) {                                                                                           \
            a##r = _mm256_add_ps(a##r, _mm256_set1_ps(bias[r0 + r]));                                         \
            b##r = _mm256_add_ps(b##r, _mm256_set1_ps(bias[r0 + r]));                                         \
        }                                                                                                     \
        if (mode & PANEL_RECTIFY) {                                                                           \
            a##r = panel_rectified_256(a##r);                                                                 \
            b##r = panel_rectified_256(b##r);                                                                 \
        }                                                                                                     \
        if (cols >= 16) {                                                                                     \
            _mm256_storeu_ps(yr, a##r);                                                                       \
            _mm256_storeu_ps(yr + 8, b##r);                                                                   \
        } else {                                                                                              \
            _mm256_maskstore_ps(yr, k0, a##r);                                                                \
            _mm256_maskstore_ps(yr + 8, k1, b##r);                                                            \
        }                                                                                                     \
    }
            PANEL_STORE(0) PANEL_STORE(1) PANEL_STORE(2) PANEL_STORE(3) PANEL_STORE(4) PANEL_STORE(5)
#undef PANEL_STORE
        }
    }
}

/* `count` (at most 16) values from src to dst: overlapping unmasked moves (AMD's masked stores are slow) */
PANEL_TARGET_256 static inline void panel_move_256(float *dst, const float *src, Py_ssize_t count) {
    copy_row(dst, src, count * (Py_ssize_t)sizeof(float));
}

PANEL_TARGET_256 static inline void panel_row_256(float *to, const float *from, Py_ssize_t live) {
    if (live >= PANEL_COLS) {
        for (int j = 0; j < PANEL_COLS; j += 8) _mm256_store_ps(to + j, _mm256_loadu_ps(from + j));
        return;
    }
    copy_row(to, from, live * (Py_ssize_t)sizeof(float));
    for (Py_ssize_t j = live; j < PANEL_COLS; j++) to[j] = 0.0f;
}

PANEL_TARGET_256 static void panel_pack_dy_256(const float *from, Py_ssize_t cols, Py_ssize_t rows, float *to,
                                               Py_ssize_t span) {
    for (Py_ssize_t t = 0; t < span; t++)
        for (Py_ssize_t i = 0; i < PANEL_ROWS; i++) to[t * PANEL_ROWS + i] = i < rows ? from[i * cols + t] : 0.0f;
}

/* The cells of the next move into a panel from lane `lane`, `left` still to move: at most 16 and none past the
   panel's end. */
static inline Py_ssize_t panel_piece(Py_ssize_t lane, Py_ssize_t left) {
    const Py_ssize_t piece = left < PANEL_COLS - lane ? left : PANEL_COLS - lane;
    return piece > 16 ? 16 : piece;
}

/* w (m x k, rows ldw apart) packed for the tiles: blocks of 12 rows, [block][k][12], the rows past m zeros. */
static void panel_pack_rows(const float *w, Py_ssize_t ldw, Py_ssize_t m, Py_ssize_t k, float *wp) {
    for (Py_ssize_t rb = 0; rb < (m + PANEL_ROWS - 1) / PANEL_ROWS; rb++)
        for (int r = 0; r < PANEL_ROWS; r++) {
            const Py_ssize_t row = rb * PANEL_ROWS + r;
            float *to = wp + rb * k * PANEL_ROWS + r;
            for (Py_ssize_t i = 0; i < k; i++) to[i * PANEL_ROWS] = row < m ? w[row * ldw + i] : 0.0f;
        }
}

/* The weight gradient's lowering (panel_weight_grad_f32) is made span by span of PANEL_SPAN output positions, and
 * the forward's (panel_conv_forward_f32) PANEL_FORWARD_PANELS panels of 32 output positions at a time. */
#define PANEL_SPAN 256
#define PANEL_FORWARD_PANELS 8

/* The kernels over the packed operands, built once per width W (panel_tile_W, panel_move_W, panel_row_W and
 * panel_pack_dy_W its own steps):
 *
 * panel_tiles_W: every tile of y's rows [0, m) and columns [0, cols) (rows ldy apart): y[r][32q + c] = (or with
 * `load` +=) Σ_i a[r / 12][i][r % 12] · panel[q][i][c] (+ bias[r]), i < k; a's blocks of 12 rows `astep` values
 * apart, the panels `pstep` apart.  A short last panel's lanes are computed and not stored.
 *
 * panel_gemm_f32_W: y (m x n, rows ldy apart) = w (m x k, rows ldw apart) @ x (k x n, rows ldx apart) (+ bias[r]
 * on row r); wp: m rounded up to 12 times k values, xp: a block's packed panels (64-byte aligned).
 *
 * panel_weight_grad_f32_W: the weight gradient of a 2-D convolution (one group, dilation 1) by the same tiles: dw
 * (o x K, rows ldw apart) += Σ over the images of dy (o x cols) @ colᵀ, col the type-1 lowering (K = c·kh·kw rows,
 * cols = oh·ow output positions).  colᵀ is never formed whole: per span of PANEL_SPAN output positions, the image's
 * windows are copied straight into panels of 32 lowered rows, panel[q][position][lane] = col[32q + lane][position]
 * (each window row's kw cells one or two moves from the zero-bordered image), and dy's rows into blocks of 12,
 * [position][12]; both stay in the core's L2 cache while the tiles add their sums into dw.
 *
 * panel_conv_forward_f32_W: the forward of a 2-D convolution (one group) by the same tiles, its lowering never
 * formed whole: each image is split by stride phase as the lowering does (im2col_f32's tables and split), then,
 * span by span of PANEL_FORWARD_PANELS panels of 32 output positions, panel[q][r][lane] = col[r][p0 + 32q + lane]
 * is copied from the phase rows (an output row's run of one kernel offset is one run of a phase row, cut at the
 * panels' edges into moves of up to 16 values) and the tiles write y (+ bias) from the panels while they sit in
 * the core's L2 cache: no lowered matrix written out and read back.  Output cells [first, last) only. */
#define DEFINE_PANEL_KERNELS(W)                                                                               \
    PANEL_TARGET_##W static void panel_tiles_##W(const float *a, Py_ssize_t astep, const float *panels,        \
                                                 Py_ssize_t pstep, Py_ssize_t k, Py_ssize_t m, Py_ssize_t cols, \
                                                 float *y, Py_ssize_t ldy, const float *bias, int mode) {     \
        for (Py_ssize_t rb = 0; rb * PANEL_ROWS < m; rb++) {                                                  \
            const int rows = m - rb * PANEL_ROWS < PANEL_ROWS ? (int)(m - rb * PANEL_ROWS) : PANEL_ROWS;      \
            for (Py_ssize_t q = 0; q * PANEL_COLS < cols; q++)                                                \
                panel_tile_##W(a + rb * astep, panels + q * pstep, k, y + rb * PANEL_ROWS * ldy + q * PANEL_COLS, \
                               ldy, rows, cols - q * PANEL_COLS, bias ? bias + rb * PANEL_ROWS : NULL, mode);  \
        }                                                                                                     \
    }                                                                                                         \
    PANEL_TARGET_##W static void panel_gemm_f32_##W(float *y, Py_ssize_t ldy, const float *w, Py_ssize_t ldw,  \
                                                    const float *x, Py_ssize_t ldx, const float *bias,         \
                                                    Py_ssize_t m, Py_ssize_t n, Py_ssize_t k, float *wp,       \
                                                    float *xp, Py_ssize_t block, int mode) {                   \
        panel_pack_rows(w, ldw, m, k, wp);  /* rows past m are zeros: computed, never stored */              \
        for (Py_ssize_t j0 = 0; j0 < n; j0 += block * PANEL_COLS) {                                           \
            const Py_ssize_t cols = n - j0 < block * PANEL_COLS ? n - j0 : block * PANEL_COLS;                \
            for (Py_ssize_t q = 0; q * PANEL_COLS < cols; q++)                                                \
                for (Py_ssize_t i = 0; i < k; i++)                                                            \
                    panel_row_##W(xp + (q * k + i) * PANEL_COLS, x + i * ldx + j0 + q * PANEL_COLS,           \
                                  cols - q * PANEL_COLS);                                                     \
            panel_tiles_##W(wp, k * PANEL_ROWS, xp, k * PANEL_COLS, k, m, cols, y + j0, ldy, bias, mode);     \
        }                                                                                                     \
    }                                                                                                         \
    PANEL_TARGET_##W static void panel_weight_grad_f32_##W(const float *x, const float *dy, float *dw,         \
                                                           Py_ssize_t ldw, Py_ssize_t o, const Py_ssize_t *g, \
                                                           float *padded, float *q, float *ap, Py_ssize_t *at) { \
        const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], kh = g[4], kw = g[5], sh = g[6], sw = g[7];   \
        const Py_ssize_t ph = g[8], pw = g[9], dh = g[10], oh = g[12], ow = g[13];                            \
        const Py_ssize_t hp = h + 2 * ph, wp = w + 2 * pw, k = c * kh * kw, cols = oh * ow;                    \
        const Py_ssize_t panels = (k + PANEL_COLS - 1) / PANEL_COLS, tail = k % PANEL_COLS;                    \
        memset(padded, 0, c * hp * wp * sizeof(float));                                                       \
        for (Py_ssize_t img = 0; img < n; img++) {                                                            \
            for (Py_ssize_t ch = 0; ch < c; ch++)                                                             \
                for (Py_ssize_t row = 0; row < h; row++)                                                      \
                    memcpy(padded + (ch * hp + row + ph) * wp + pw, x + ((img * c + ch) * h + row) * w,       \
                           w * sizeof(float));                                                                \
            const float *dyi = dy + img * o * cols;                                                           \
            for (Py_ssize_t p0 = 0; p0 < cols; p0 += PANEL_SPAN) {                                            \
                const Py_ssize_t span = cols - p0 < PANEL_SPAN ? cols - p0 : PANEL_SPAN;                      \
                Py_ssize_t r = p0 / ow, v = p0 % ow;                                                          \
                for (Py_ssize_t t = 0; t < span; t++) { /* each position's window corner in the padded image */ \
                    at[t] = r * sh * wp + v * sw;                                                             \
                    if (++v == ow) {                                                                          \
                        v = 0;                                                                                \
                        r++;                                                                                  \
                    }                                                                                         \
                }                                                                                             \
                if (tail) /* the last panel's lanes past k: zeros */                                          \
                    for (Py_ssize_t t = 0; t < span; t++)                                                     \
                        memset(q + ((panels - 1) * PANEL_SPAN + t) * PANEL_COLS + tail, 0,                    \
                               (PANEL_COLS - tail) * sizeof(float));                                          \
                /* every window row's kw cells, one piece (at most 16 cells within a panel) at a time */      \
                for (Py_ssize_t ch = 0; ch < c; ch++)                                                         \
                    for (Py_ssize_t i = 0; i < kh; i++) {                                                     \
                        const float *corner = padded + (ch * hp + i * dh) * wp;                               \
                        const Py_ssize_t k0 = (ch * kh + i) * kw;                                             \
                        for (Py_ssize_t j = 0; j < kw;) {                                                     \
                            const Py_ssize_t kk = k0 + j, lane = kk % PANEL_COLS;                             \
                            const Py_ssize_t piece = panel_piece(lane, kw - j);                               \
                            const float *src = corner + j;                                                    \
                            float *dst = q + kk / PANEL_COLS * PANEL_SPAN * PANEL_COLS + lane;                \
                            for (Py_ssize_t t = 0; t < span; t++)                                             \
                                panel_move_##W(dst + t * PANEL_COLS, src + at[t], piece);                     \
                            j += piece;                                                                       \
                        }                                                                                     \
                    }                                                                                         \
                for (Py_ssize_t rb = 0; rb * PANEL_ROWS < o; rb++) /* dy's rows in blocks of 12 */            \
                    panel_pack_dy_##W(dyi + rb * PANEL_ROWS * cols + p0, cols,                                \
                                      o - rb * PANEL_ROWS < PANEL_ROWS ? o - rb * PANEL_ROWS : PANEL_ROWS,    \
                                      ap + rb * PANEL_SPAN * PANEL_ROWS, span);                               \
                panel_tiles_##W(ap, PANEL_SPAN * PANEL_ROWS, q, PANEL_SPAN * PANEL_COLS, span, o, k, dw, ldw,  \
                                NULL, PANEL_LOAD);                                                            \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    PANEL_TARGET_##W static void panel_conv_forward_f32_##W(const float *x, const float *wp, const float *bias, \
                                                            float *y, Py_ssize_t o, const Py_ssize_t *g,      \
                                                            float *buf, Py_ssize_t pe_h, Py_ssize_t pe_w,     \
                                                            Py_ssize_t *table, float *panels,                 \
                                                            Py_ssize_t first, Py_ssize_t last, int mode) {    \
        const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], *k = g + 4;                                  \
        const Py_ssize_t kh = k[0], kw = k[1], sh = k[2], sw = k[3], oh = k[8], ow = k[9];                    \
        const Py_ssize_t phase = pe_h * pe_w, chan = sh * sw * phase, rows = c * kh * kw, cols = oh * ow;     \
        const Py_ssize_t span_max = PANEL_FORWARD_PANELS * PANEL_COLS, *offset = table + h + 2 * sw;           \
        im2col_f32_tables(h, w, k, pe_h, pe_w, table);                                                        \
        memset(buf, 0, c * chan * sizeof(float));                                                             \
        for (Py_ssize_t img = 0; img < n; img++) {                                                            \
            im2col_f32_split(x, img, c, h, w, k, buf, phase, table);                                          \
            float *yi = y + img * o * cols;                                                                   \
            for (Py_ssize_t p0 = first; p0 < last; p0 += span_max) {                                          \
                const Py_ssize_t span = last - p0 < span_max ? last - p0 : span_max;                          \
                const Py_ssize_t r0 = p0 / ow, v0 = p0 % ow;                                                  \
                for (Py_ssize_t ch = 0; ch < c; ch++)                                                         \
                    for (Py_ssize_t t = 0; t < kh * kw; t++) {                                                \
                        const float *src = buf + ch * chan + offset[t];                                       \
                        float *dst = panels + (ch * kh * kw + t) * PANEL_COLS;                                \
                        Py_ssize_t at = 0, r = r0, v = v0; /* at: the span's position; (r, v): its output cell */ \
                        while (at < span) {                                                                   \
                            const Py_ssize_t run = ow - v < span - at ? ow - v : span - at;                   \
                            const float *from = src + r * pe_w + v;                                           \
                            for (Py_ssize_t done = 0; done < run;) {                                          \
                                const Py_ssize_t pos = at + done, lane = pos % PANEL_COLS;                    \
                                const Py_ssize_t piece = panel_piece(lane, run - done);                       \
                                panel_move_##W(dst + pos / PANEL_COLS * rows * PANEL_COLS + lane, from + done, piece); \
                                done += piece;                                                                \
                            }                                                                                 \
                            at += run;                                                                        \
                            v = 0;                                                                            \
                            r++;                                                                              \
                        }                                                                                     \
                    }                                                                                         \
                panel_tiles_##W(wp, rows * PANEL_ROWS, panels, rows * PANEL_COLS, rows, o, span, yi + p0, cols, \
                                bias, mode);                                                                  \
            }                                                                                                 \
        }                                                                                                     \
    }

DEFINE_PANEL_KERNELS(512)
DEFINE_PANEL_KERNELS(256)
#define HAVE_PANEL_GEMM 1
#endif

/* The panel kernels' packed operands: a buffer each thread keeps for its next call (a layer's partitions call once
 * per image: fresh pages every time would be faulted in again) up to PANEL_SCRATCH_KEEP bytes — a bigger one (a
 * wide layer's padded or phase-split image) is handed back after the call by panel_scratch_trim; NULL when out of
 * memory. */
#define PANEL_SCRATCH_KEEP (4 << 20)
static __thread float *panel_buffer = NULL;
static __thread Py_ssize_t panel_held = 0;

static float *panel_scratch(Py_ssize_t bytes) {
    if (bytes > panel_held) {
        free(panel_buffer);
        panel_buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        panel_held = panel_buffer ? bytes : 0;
    }
    return panel_buffer;
}

static void panel_scratch_trim(void) {
    if (panel_held > PANEL_SCRATCH_KEEP) {
        free(panel_buffer);
        panel_buffer = NULL;
        panel_held = 0;
    }
}

/* A 2-D float32 view unit-strided along its rows; its row stride in values into *ld (0: not such a view). */
static int panel_operand(const Py_buffer *v, Py_ssize_t *ld) {
    if (v->ndim != 2 || v->itemsize != 4 || !v->format || strcmp(v->format, "f") != 0) return 0;
    if (v->shape[0] == 0 || v->shape[1] == 0) {  /* empty: nothing read or written, whatever its strides */
        *ld = v->shape[1];
        return 1;
    }
    if (v->shape[1] > 1 && v->strides[1] != 4) return 0;
    if (v->shape[0] > 1 && (v->strides[0] <= 0 || v->strides[0] % 4 || v->strides[0] / 4 < v->shape[1])) return 0;
    *ld = v->shape[0] > 1 ? v->strides[0] / 4 : v->shape[1];
    return 1;
}

static PyObject *panel_gemm(PyObject *self, PyObject *args) {
    PyObject *o[4];
    Py_buffer v[4];
    int held = 0, done = 0, rectify = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO|p", &o[0], &o[1], &o[2], &o[3], &rectify)) return NULL;  /* y, w, x, bias */
    const int count = o[3] == Py_None ? 3 : 4;
    for (; held < count; held++)
        if (PyObject_GetBuffer(o[held], &v[held], PyBUF_STRIDES | PyBUF_FORMAT | (held ? 0 : PyBUF_WRITABLE)) < 0)
            goto out;
#ifdef HAVE_PANEL_GEMM
    Py_ssize_t ld[3];
    const int width = panel_width();
    int fits = width != 0;
    for (int i = 0; i < 3 && fits; i++) fits = panel_operand(&v[i], &ld[i]);
    if (fits && count == 4)
        fits = v[3].ndim == 1 && v[3].itemsize == 4 && v[3].format && strcmp(v[3].format, "f") == 0 &&
               v[3].shape[0] == v[0].shape[0] && (v[3].shape[0] < 2 || v[3].strides[0] == 4);
    if (!fits || v[1].shape[1] != v[2].shape[0] || v[0].shape[0] != v[1].shape[0] || v[0].shape[1] != v[2].shape[1])
        goto out;
    const Py_ssize_t m = v[1].shape[0], k = v[1].shape[1], n = v[2].shape[1];
    done = 1;
    if (m == 0 || n == 0) goto out;
    if (k == 0) {  /* an empty sum: the bias, or zeros */
        for (Py_ssize_t r = 0; r < m; r++)
            for (Py_ssize_t j = 0; j < n; j++) {
                const float value = count == 4 ? ((const float *)v[3].buf)[r] : 0.0f;
                ((float *)v[0].buf)[r * ld[0] + j] = RECTIFIED(float, value, rectify);
            }
        goto out;
    }
    Py_ssize_t block = PANEL_BLOCK_BYTES / (k * PANEL_COLS * 4);
    block = block < 1 ? 1 : block > 8 ? 8 : block;
    const Py_ssize_t wbytes = ((m + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS * k * 4 + 63) / 64 * 64;
    float *packed = panel_scratch(wbytes + block * k * PANEL_COLS * 4);
    if (!packed) {
        for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    (width == 64 ? panel_gemm_f32_512 : panel_gemm_f32_256)(v[0].buf, ld[0], v[1].buf, ld[1], v[2].buf, ld[2],
                                                            count == 4 ? v[3].buf : NULL, m, n, k, packed,
                                                            packed + wbytes / 4, block, rectify ? PANEL_RECTIFY : 0);
    Py_END_ALLOW_THREADS
    panel_scratch_trim();
#endif
out:
    for (int i = 0; i < held; i++) PyBuffer_Release(&v[i]);
    if (held < count) return NULL;
    return PyBool_FromLong(done);
}

/* The end of a convolution's panel entry: its buffers released; done 1 (computed), 0 (declined) or -1 (an error
   set). */
static PyObject *panel_done(int done, buffers *b, Py_buffer *v) {
    release(b);
    PyBuffer_Release(v);
    return done < 0 ? NULL : PyBool_FromLong(done);
}

static PyObject *panel_weight_grad(PyObject *self, PyObject *args) {
    PyObject *ox, *ody, *odw, *geometry;
    Py_ssize_t g[14], pad_h, pad_w;
    buffers b = {.held = 0};
    void *x, *dy;
    Py_buffer v;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO", &ox, &ody, &odw, &geometry) ||
        lowering_geometry(geometry, g, &pad_h, &pad_w) < 0)
        return NULL;
    if (PyObject_GetBuffer(odw, &v, PyBUF_STRIDES | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) return NULL;
    int done = 0;
#ifdef HAVE_PANEL_GEMM
    Py_ssize_t ldw;
    const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], kh = g[4], kw = g[5], oh = g[12], ow = g[13];
    const Py_ssize_t hp = h + 2 * g[8], wp = w + 2 * g[9];
    const int width = panel_width();
    if (!width || !panel_operand(&v, &ldw) || v.shape[1] != c * kh * kw || g[11] != 1 ||
        pad_h != hp || pad_w != wp || item_size(ox) != 4)
        goto out;
    const Py_ssize_t o = v.shape[0], k = v.shape[1];
    if (take(&b, ox, 0, 4, n * c * h * w, "x", &x, 0) < 0 || take(&b, ody, 0, 4, n * o * oh * ow, "dy", &dy, 0) < 0) {
        done = -1;
        goto out;
    }
    done = 1;
    if (n == 0 || o == 0 || k == 0 || oh * ow == 0) goto out;
    const Py_ssize_t pbytes = (c * hp * wp * 4 + 63) / 64 * 64;
    const Py_ssize_t qbytes = (k + PANEL_COLS - 1) / PANEL_COLS * PANEL_SPAN * PANEL_COLS * 4;
    const Py_ssize_t abytes = (o + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_SPAN * PANEL_ROWS * 4;
    float *scratch = panel_scratch(pbytes + qbytes + abytes + PANEL_SPAN * (Py_ssize_t)sizeof(Py_ssize_t));
    if (!scratch) {
        PyErr_NoMemory();
        done = -1;
        goto out;
    }
    Py_BEGIN_ALLOW_THREADS
    (width == 64 ? panel_weight_grad_f32_512 : panel_weight_grad_f32_256)(
        x, dy, v.buf, ldw, o, g, scratch, scratch + pbytes / 4, scratch + (pbytes + qbytes) / 4,
        (Py_ssize_t *)(scratch + (pbytes + qbytes + abytes) / 4));
    Py_END_ALLOW_THREADS
    panel_scratch_trim();
#endif
out:
    return panel_done(done, &b, &v);
}

static PyObject *panel_conv_forward(PyObject *self, PyObject *args) {
    PyObject *ox, *ow_, *obias, *oy, *geometry;
    Py_ssize_t g[14], pad_h, pad_w, first = 0, last = -1;
    int rectify = 0;
    buffers b = {.held = 0};
    void *x, *y, *bias = NULL;
    Py_buffer v;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOO|nnp", &ox, &ow_, &obias, &oy, &geometry, &first, &last, &rectify) ||
        lowering_geometry(geometry, g, &pad_h, &pad_w) < 0)
        return NULL;
    if (last < 0) last = g[12] * g[13];
    if (first < 0 || first > last || last > g[12] * g[13]) {
        PyErr_SetString(PyExc_ValueError, "panel_conv_forward: output cells [first, last) out of range");
        return NULL;
    }
    if (PyObject_GetBuffer(ow_, &v, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return NULL;
    int done = 0;
#ifdef HAVE_PANEL_GEMM
    Py_ssize_t ldw;
    const Py_ssize_t n = g[0], c = g[1], h = g[2], w = g[3], *k = g + 4;
    const int width = panel_width();
    if (!width || !panel_operand(&v, &ldw) || v.shape[1] != c * k[0] * k[1] ||
        item_size(ox) != 4)
        goto out;
    const Py_ssize_t o = v.shape[0], rows = v.shape[1], cols = k[8] * k[9];
    if (take(&b, ox, 0, 4, n * c * h * w, "x", &x, 0) < 0 || take(&b, oy, 1, 4, n * o * cols, "y", &y, 0) < 0 ||
        (obias != Py_None && take(&b, obias, 0, 4, o, "bias", &bias, 0) < 0)) {
        done = -1;
        goto out;
    }
    done = 1;
    if (n == 0 || o == 0 || first == last) goto out;
    if (rows == 0) {  /* an empty sum: the bias, or zeros */
        for (Py_ssize_t i = 0; i < n * o; i++)
            for (Py_ssize_t j = first; j < last; j++) {
                const float value = bias ? ((const float *)bias)[i % o] : 0;
                ((float *)y)[i * cols + j] = RECTIFIED(float, value, rectify);
            }
        goto out;
    }
    /* the scratch: the image by stride phase (as lowering()), the tables, w packed, the span's panels (64-byte
     * aligned: the tiles' aligned loads) */
    const Py_ssize_t pe_h = (pad_h + k[2] - 1) / k[2], pe_w = (pad_w + k[3] - 1) / k[3];
    const Py_ssize_t bbytes = (c * k[2] * k[3] * pe_h * pe_w * 4 + 63) / 64 * 64;
    const Py_ssize_t tbytes = ((h + 2 * k[3] + k[0] * k[1]) * (Py_ssize_t)sizeof(Py_ssize_t) + 63) / 64 * 64;
    const Py_ssize_t wbytes = ((o + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS * rows * 4 + 63) / 64 * 64;
    float *scratch = panel_scratch(bbytes + tbytes + wbytes + PANEL_FORWARD_PANELS * rows * PANEL_COLS * 4);
    if (!scratch) {
        PyErr_NoMemory();
        done = -1;
        goto out;
    }
    float *wp = scratch + (bbytes + tbytes) / 4;
    Py_BEGIN_ALLOW_THREADS
    panel_pack_rows(v.buf, ldw, o, rows, wp);
    (width == 64 ? panel_conv_forward_f32_512 : panel_conv_forward_f32_256)(
        x, wp, bias, y, o, g, scratch, pe_h, pe_w, (Py_ssize_t *)(scratch + bbytes / 4), wp + wbytes / 4, first, last,
        rectify ? PANEL_RECTIFY : 0);
    Py_END_ALLOW_THREADS
    panel_scratch_trim();
#endif
out:
    return panel_done(done, &b, &v);
}

/* vector_width(bytes=0): the register width (16, 32 or 64 bytes) the width-specific kernels run at; with bytes,
 * run them at that width from now on (0: the machine's widest) and return the previous one */
static PyObject *vector_width(PyObject *self, PyObject *args) {
    int bytes = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "|i", &bytes)) return NULL;
    const int widest = widest_vector_bytes(), previous = vector_bytes();
    if (bytes != 0 && bytes != 16 && bytes != 32 && bytes != 64) {
        PyErr_Format(PyExc_ValueError, "vector width %d bytes: expected 16, 32 or 64", bytes);
        return NULL;
    }
    if (bytes > widest) {
        PyErr_Format(PyExc_ValueError, "vector width %d bytes: this CPU's widest vectors are %d bytes", bytes, widest);
        return NULL;
    }
    if (bytes) vector_bytes_set = bytes;
    else if (PyTuple_GET_SIZE(args)) vector_bytes_set = widest;
    return PyLong_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"max_pool_forward", max_pool_forward, METH_VARARGS,
     "max_pool_forward(geometry, x, ymax, y, winners, codes): N-D MAX pooling of C-contiguous planes; y and "
     "winners may be None"},
    {"max_pool_backward", max_pool_backward, METH_VARARGS,
     "max_pool_backward(geometry, dy, ymax, winners, delta, dx, accumulate, positive): route each window's "
     "gradient to its winner"},
    {"ave_pool_forward", ave_pool_forward, METH_VARARGS,
     "ave_pool_forward(geometry, x, size, y): N-D AVE pooling of C-contiguous planes, each window's sum divided by "
     "size (one plane's outputs)"},
    {"ave_pool_backward", ave_pool_backward, METH_VARARGS,
     "ave_pool_backward(geometry, dy, inv, dx, accumulate): its gradient, dy * inv (one plane's outputs) added at "
     "every cell of each window"},
    {"lowering", lowering, METH_VARARGS,
     "lowering(src, dst, (n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow), adjoint, last): 2-D im2col, x (n, c, "
     "h, w) -> col (c, kh, kw, n, oh, ow), or with `last` (c, kh, kw, oh, ow, n); `adjoint`: its col2im, col -> dx "
     "(n, c, h, w) overwritten"},
    {"lrn_forward", lrn_forward, METH_VARARGS,
     "lrn_forward(x, scale, y, n, c, hw, size, k, coeff): LRN across channels, beta 3/4"},
    {"lrn_backward", lrn_backward, METH_VARARGS,
     "lrn_backward(x, y, dy, scale, dx, n, c, hw, size, gain): its gradient, gain = -2*coeff*beta"},
    {"depthwise", depthwise, METH_VARARGS,
     "depthwise(which, src, other, dst, bias, (n, c, o, h, w, kh, kw, sh, sw, ph, pw, dh, dw, oh, ow), first, last): "
     "a 2-D convolution with one input channel per group: which 0 y = conv(x, w) (+ bias) on y's planes [first, "
     "last), 1 dx = its transpose of dy on dx's planes [first, last), 2 dw += correlation of x with dy for output "
     "channels [first, last)"},
    {"depthwise_backward", depthwise_backward, METH_VARARGS,
     "depthwise_backward(x, dy, w, dx, dw, geometry, first, last): both gradients of input channels [first, last) "
     "in one pass (one output per channel, stride 1, coinciding layouts: depthwise()'s bits); False where that "
     "does not apply, nothing computed (first == last asks)"},
    {"add_rectified", add_rectified, METH_VARARGS,
     "add_rectified(a, b, out): out = maximum(a + b, 0) as numpy makes it (NaN kept, -0.0 to +0); out may be a"},
    {"relu_backward", relu_backward, METH_VARARGS,
     "relu_backward(x, dy, dx): dx = dy * (x > 0); dx may be dy"},
    {"all_finite", all_finite, METH_VARARGS, "all_finite(x): whether every value of x is finite (no inf, no NaN)"},
    {"add_bias", add_bias, METH_VARARGS,
     "add_bias(y, bias, channels, cells, rectify=False): y (images, channels, cells) += bias[c] in place (bias may "
     "be None), then (rectify) numpy's maximum(y, 0), in one pass"},
    {"transpose", transpose, METH_VARARGS,
     "transpose(src, dst, rows, cols, bias, cells, rectify=False): dst (cols, rows) = src (rows, cols) transposed, "
     "plus bias[i // cells] on source row i (bias may be None), then (rectify) numpy's maximum(dst, 0)"},
    {"winograd_tiles", winograd_tiles, METH_VARARGS,
     "winograd_tiles(src, dst, (n, rows, cols, channels, tiles_h, tiles_w, m), gradient=False): dst (n*tiles_h*"
     "tiles_w, a², channels), a = m + 2, = F(m x m, 3 x 3)'s Bᵀ d B of each a x a tile d of src (n, rows, cols, "
     "channels) at rows i*m.., columns j*m.. (gradient: A d Aᵀ of each m x m tile); m is 2 or 4"},
    {"winograd_untile", winograd_untile, METH_VARARGS,
     "winograd_untile(src, y, bias, (n, channels, out_h, out_w, tiles_h, tiles_w, m), rectify=False): y (n, "
     "channels, out_h, out_w) = Aᵀ M A of each tile's a x a values M of src (n*tiles_h*tiles_w, a², channels), cut "
     "to the output, plus bias (may be None), then (rectify) numpy's maximum(y, 0)"},
    {"label_count", label_count, METH_VARARGS,
     "label_count(label, classes, ignore): positions whose label (truncated) is not `ignore` (None: none is), or "
     "-1 where one lies outside [0, classes)"},
    {"softmax_loss_backward", softmax_loss_backward, METH_VARARGS,
     "softmax_loss_backward(p, label, dx, (outer, classes, inner), scale, ignore): dx = (p - onehot(label)) * "
     "scale, 0 at ignored positions"},
    {"set_gemm", set_gemm, METH_VARARGS,
     "set_gemm(itemsize, address, ilp64): the cblas ?gemm gemm_accumulate calls for items of that size"},
    {"gemm_accumulate", gemm_accumulate, METH_VARARGS,
     "gemm_accumulate(out, a, b): out += a @ b by one BLAS call (beta = 1) on 2-D views as they lie; False "
     "(nothing done) where the BLAS cannot take them or set_gemm was not called for their type"},
    {"panel_gemm", panel_gemm, METH_VARARGS,
     "panel_gemm(y, w, x, bias, rectify=False): y = w @ x (+ bias per row), then (rectify) numpy's maximum(y, 0), "
     "on float32 2-D views unit-strided along their rows, by "
     "12 x 32 tiles over packed panels; False (nothing done) where the CPU has neither AVX-512F nor AVX2 with FMA "
     "(or the vector width in use is 16 bytes) or the arrays do not fit"},
    {"panel_conv_forward", panel_conv_forward, METH_VARARGS,
     "panel_conv_forward(x, w, bias, y, geometry, first=0, last=-1, rectify=False): y = the 2-D convolution of x "
     "with w (o, c*kh*kw) (+ bias; then, rectify, numpy's maximum(y, 0)) for one group (lowering() geometry) on "
     "each image's output cells [first, last) (-1: all), lowered span by span into the panel GEMM's panels; False "
     "(nothing done) where the CPU has neither AVX-512F nor AVX2 with FMA or the arguments do not fit"},
    {"panel_weight_grad", panel_weight_grad, METH_VARARGS,
     "panel_weight_grad(x, dy, dw, geometry): dw (o, c*kh*kw) += the weight gradient of a 2-D convolution of one "
     "group (lowering() geometry, dilation 1 along the rows) over the images, by the panel GEMM's tiles on lowered "
     "panels made span by span; False (nothing done) where the CPU has neither AVX-512F nor AVX2 with FMA or the "
     "arguments do not fit"},
    {"vector_width", vector_width, METH_VARARGS,
     "vector_width(bytes=0): the register width in bytes (16, 32, 64) the kernels built per width run at; with "
     "bytes, that width from now on (0: the CPU's widest), returning the previous one"},
    {"sgd_update", sgd_update, METH_VARARGS,
     "sgd_update(w, g, h, normalize, norm, decay, l1, rate, momentum): Caffe's SGD step on w, g (the update "
     "left in it) and history h, in place"},
    {"row_moments", row_moments, METH_VARARGS,
     "row_moments(x, mean, m2, cells): per row of `cells` values, its mean and the sum of squared deviations"},
    {"row_sums", row_sums, METH_VARARGS,
     "row_sums(a, b, sums, dots, cells): per row, the sum of a and (b not None) of a*b"},
    {"normalize_rows", normalize_rows, METH_VARARGS,
     "normalize_rows(x, mean, std, out, copy, cells): out = (x - mean[c]) / std[c] (mean None: x / std[c]), "
     "copy = out when not None; row r has channel r % len(std)"},
    {"scale_rows", scale_rows, METH_VARARGS,
     "scale_rows(x, scale, bias, out, save, cells): save = x when not None, out = x * scale[c] (+ bias[c])"},
    {"normalize_backward_rows", normalize_backward_rows, METH_VARARGS,
     "normalize_backward_rows(dy, y, a, b, std, out, cells): out = (dy - (y * a[c] + b[c])) / std[c]"},
    {"normalize_scale_rows", normalize_scale_rows, METH_VARARGS,
     "normalize_scale_rows(x, mean, std, scale, bias, out, copy, cells, rectify=False): copy = (x - mean[c]) / "
     "std[c] (mean None: x / std[c]), out = copy * scale[c] (+ bias[c]), then (rectify) numpy's maximum(out, 0)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* The version of the functions' arguments and meaning: cct.native ignores a module of another version (a copy
 * left in a checkout by an older build). */
#define CCT_KERNELS_API 22
/* The digest of this source (setup.py defines it): the machine's measured speeds of the kernels are kept per source */
#ifndef CCT_KERNELS_SOURCE
#define CCT_KERNELS_SOURCE "unknown"
#endif

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "API_VERSION", CCT_KERNELS_API) < 0 ||
              PyModule_AddStringConstant(m, "SOURCE", CCT_KERNELS_SOURCE) < 0
#ifdef HAVE_PANEL_GEMM
              || PyModule_AddIntConstant(m, "PANEL_COLS", PANEL_COLS) < 0  /* the tiles' width in output cells */
#endif
              )) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
