/* Compiled kernels for the layers whose numpy form is bound by many short passes over memory (see
 * cct/native/__init__.py).  Each kernel works on C-contiguous buffers (float32 or float64, chosen by the
 * buffer's item size), walks one channel plane at a time while it sits in the core's cache, and releases the
 * GIL, so the batch partitions' threads run it side by side.
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

typedef struct {
    Py_ssize_t planes, h, w, oh, ow;  /* channel planes (N*C), input and output extents */
    Py_ssize_t kh, kw, sh, sw, ph, pw, dh, dw;  /* kernel, stride, pad, dilation */
} pool_geometry;

/* MAX pooling forward, one plane at a time: the plane's rows are copied by stride phase into a padded buffer
 * (padded row u*sh + a is row u of phase a, each row sw*pe_w cells wide; -inf outside the image, which never
 * beats -FLT_MAX), so each kernel offset's cells for every window lie at one fixed shift of one phase, sw
 * apart: window (r, k) at wide position q = r*pe_w + k reads phase[t][sw*q + shift[t]].  Each offset is then
 * one long pass over the wide grid (positions k >= ow read neighbouring cells and are dropped), which
 * vectorizes; the wide grid's rows are cut to ow at the end. */
#define SCAN_BLOCK 16  /* the scan's vector lanes (float32; float64 uses 8) */

typedef struct {
    Py_ssize_t pe_h, pe_w, row, block, wide, k;  /* phase rows, wide row, buffer row, one phase, wide grid */
    Py_ssize_t *phase, *shift;                   /* per kernel offset (row-major) */
} pool_scan;

static int scan_setup(const pool_geometry *g, pool_scan *s) {
    Py_ssize_t ext_h = (g->kh - 1) * g->dh + 1, ext_w = (g->kw - 1) * g->dw + 1;
    Py_ssize_t pad_h = g->h + 2 * g->ph, pad_w = g->w + 2 * g->pw, max_shift = 0;
    if ((g->oh - 1) * g->sh + ext_h > pad_h) pad_h = (g->oh - 1) * g->sh + ext_h;
    if ((g->ow - 1) * g->sw + ext_w > pad_w) pad_w = (g->ow - 1) * g->sw + ext_w;
    s->pe_h = (pad_h + g->sh - 1) / g->sh;
    s->pe_w = (pad_w + g->sw - 1) / g->sw;
    s->row = s->pe_w * g->sw;
    s->k = g->kh * g->kw;
    s->wide = (g->oh * s->pe_w + SCAN_BLOCK - 1) / SCAN_BLOCK * SCAN_BLOCK;
    s->phase = malloc(2 * s->k * sizeof(Py_ssize_t));
    if (!s->phase) return -1;
    s->shift = s->phase + s->k;
    for (Py_ssize_t i = 0; i < g->kh; i++)
        for (Py_ssize_t j = 0; j < g->kw; j++) {
            Py_ssize_t t = i * g->kw + j, ci = i * g->dh;
            s->phase[t] = ci % g->sh;
            s->shift[t] = (ci / g->sh) * s->row + j * g->dw;
            if (s->shift[t] > max_shift) max_shift = s->shift[t];
        }
    /* a phase's block: its rows plus room for the largest shift past the wide grid's end */
    s->block = s->pe_h * s->row;
    if (g->sw * (s->wide + SCAN_BLOCK) + max_shift > s->block) s->block = g->sw * (s->wide + SCAN_BLOCK) + max_shift;
    return 0;
}

#define DEFINE_SPLIT(NAME, T)                                                                                \
    /* the image rows of one plane into the phase buffer (its border keeps -inf from the first fill) */     \
    static void NAME(const pool_geometry *g, const pool_scan *s, const T *x, T *buf) {                       \
        for (Py_ssize_t h = 0; h < g->h; h++) {                                                              \
            Py_ssize_t padded = h + g->ph;                                                                   \
            memcpy(buf + (padded % g->sh) * s->block + (padded / g->sh) * s->row + g->pw, x + h * g->w,     \
                   g->w * sizeof(T));                                                                        \
        }                                                                                                    \
    }

/* The scan one vector of wide positions at a time, its maxima and codes held in registers over the kernel
 * offsets (GCC/clang vector extensions; the clones widen them to each machine's registers).  The wide grid
 * is padded to whole vectors and each phase's block has room for the last vector's reads. */
#define DEFINE_SCAN(NAME, T, IT, LANES)                                                                      \
    typedef T NAME##_vec __attribute__((vector_size(LANES * sizeof(T))));                                    \
    typedef IT NAME##_ivec __attribute__((vector_size(LANES * sizeof(T))));                                  \
    typedef uint8_t NAME##_bvec __attribute__((vector_size(LANES)));                                         \
    /* best[q] = max over the offsets (and -FLT_MAX) and code[q] the winning offset's code (0: none) */      \
    CCT_CLONES static void NAME(const pool_geometry *g, const pool_scan *s, const T *buf, T *best,           \
                                uint8_t *code, const uint8_t *codes) {                                       \
        const Py_ssize_t n = s->wide, sw = g->sw;                                                            \
        for (Py_ssize_t q0 = 0; q0 < n; q0 += LANES) {                                                       \
            NAME##_vec b, v = {0}, lo, hi;                                                                   \
            NAME##_ivec cd = {0}, gt;                                                                        \
            for (int l = 0; l < LANES; l++) b[l] = (T)-FLT_MAX;                                              \
            for (Py_ssize_t t = 0; t < s->k; t++) {                                                          \
                const T *cell = buf + s->phase[t] * s->block + s->shift[t] + sw * q0;                        \
                if (sw == 1) {                                                                               \
                    memcpy(&v, cell, sizeof v);                                                              \
                } else if (sw == 2) {                                                                        \
                    memcpy(&lo, cell, sizeof lo);                                                            \
                    memcpy(&hi, cell + LANES, sizeof hi);                                                    \
                    v = EVEN_LANES_##LANES(lo, hi);                                                          \
                } else {                                                                                     \
                    for (int l = 0; l < LANES; l++) v[l] = cell[sw * l];                                     \
                }                                                                                            \
                gt = v > b;                                                                                  \
                cd = (cd & ~gt) | ((IT)codes[t] & gt);                                                       \
                b = (NAME##_vec)(((NAME##_ivec)b & ~gt) | ((NAME##_ivec)v & gt));                            \
            }                                                                                                \
            memcpy(best + q0, &b, sizeof b);                                                                 \
            NAME##_bvec packed = __builtin_convertvector(cd, NAME##_bvec);                                   \
            memcpy(code + q0, &packed, sizeof packed);                                                       \
        }                                                                                                    \
    }

#if defined(__clang__) || __GNUC__ >= 12
#define EVEN_LANES_16(a, b) \
    __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define EVEN_LANES_8(a, b) __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14)
#else /* older GCC: the same selection by an index vector */
typedef int32_t even_index_16 __attribute__((vector_size(64)));
typedef int64_t even_index_8 __attribute__((vector_size(64)));
#define EVEN_LANES_16(a, b) \
    __builtin_shuffle(a, b, (even_index_16){0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30})
#define EVEN_LANES_8(a, b) __builtin_shuffle(a, b, (even_index_8){0, 2, 4, 6, 8, 10, 12, 14})
#endif

DEFINE_SPLIT(split_f32, float)
DEFINE_SPLIT(split_f64, double)
DEFINE_SCAN(scan_f32, float, int32_t, 16)
DEFINE_SCAN(scan_f64, double, int64_t, 8)

#define DEFINE_CUT(NAME, T)                                                                                  \
    /* the wide grid's rows cut to the output's width: maxima into ymax (and y), codes into win */          \
    CCT_CLONES static void NAME(const pool_geometry *g, const pool_scan *s, const T *best, const uint8_t *code,\
                                T *restrict ymax, T *restrict y, uint8_t *restrict win) {                    \
        for (Py_ssize_t r = 0; r < g->oh; r++) {                                                             \
            const T *b = best + r * s->pe_w;                                                                 \
            const uint8_t *c = code + r * s->pe_w;                                                           \
            T *m = ymax + r * g->ow;                                                                         \
            for (Py_ssize_t k = 0; k < g->ow; k++) m[k] = b[k];                                              \
            if (y)                                                                                           \
                for (Py_ssize_t k = 0; k < g->ow; k++) y[r * g->ow + k] = b[k];                              \
            if (win)                                                                                         \
                for (Py_ssize_t k = 0; k < g->ow; k++) win[r * g->ow + k] = c[k];                            \
        }                                                                                                    \
    }

DEFINE_CUT(cut_f32, float)
DEFINE_CUT(cut_f64, double)

#define DEFINE_MAX_FORWARD(NAME, SPLIT, SCAN, CUT, T)                                                        \
    static void NAME(const pool_geometry *g, const pool_scan *s, const T *x, T *ymax, T *y, uint8_t *win,    \
                     const uint8_t *codes, T *buf, T *best, uint8_t *code) {                                 \
        Py_ssize_t p, plane = g->h * g->w, oplane = g->oh * g->ow;                                           \
        for (Py_ssize_t i = 0; i < g->sh * s->block; i++) buf[i] = (T)-INFINITY;                             \
        for (p = 0; p < g->planes; p++) {                                                                    \
            SPLIT(g, s, x + p * plane, buf);                                                                 \
            SCAN(g, s, buf, best, code, codes);                                                              \
            CUT(g, s, best, code, ymax + p * oplane, y ? y + p * oplane : NULL, win ? win + p * oplane : NULL); \
        }                                                                                                    \
    }

DEFINE_MAX_FORWARD(max_forward_f32, split_f32, scan_f32, cut_f32, float)
DEFINE_MAX_FORWARD(max_forward_f64, split_f64, scan_f64, cut_f64, double)

/* dx[plane, start(o) + delta[code[o]]] += dy[o] (times ymax[o] > 0 with positive), windows in order. */
#define DEFINE_MAX_BACKWARD(NAME, T)                                                                         \
    static void NAME(const pool_geometry *g, const T *dy, const T *ymax, const uint8_t *win,               \
                     const int64_t *delta, T *dx, int accumulate, int positive) {                            \
        Py_ssize_t p, r, k, plane = g->h * g->w, oplane = g->oh * g->ow;                                     \
        for (p = 0; p < g->planes; p++) {                                                                    \
            T *d = dx + p * plane;                                                                           \
            if (!accumulate) memset(d, 0, plane * sizeof(T));                                                \
            for (r = 0; r < g->oh; r++) {                                                                    \
                Py_ssize_t at = p * oplane + r * g->ow;                                                      \
                Py_ssize_t start = (r * g->sh - g->ph) * g->w - g->pw;                                       \
                for (k = 0; k < g->ow; k++) {                                                                \
                    uint8_t c = win[at + k];                                                                 \
                    if (!c) continue;                                                                        \
                    T v = dy[at + k];                                                                        \
                    if (positive) v = v * (T)(ymax[at + k] > 0);                                             \
                    Py_ssize_t at_cell = start + k * g->sw + delta[c];                                        \
                    if (at_cell >= 0 && at_cell < plane) d[at_cell] += v;                                    \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_MAX_BACKWARD(max_backward_f32, float)
DEFINE_MAX_BACKWARD(max_backward_f64, double)

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

/* ---- argument handling ------------------------------------------------------------------------------- */

typedef struct {
    Py_buffer views[6];
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

static int parse_geometry(PyObject *geometry, pool_geometry *g) {
    Py_ssize_t *f[] = {&g->planes, &g->h, &g->w, &g->oh, &g->ow, &g->kh, &g->kw,
                       &g->sh, &g->sw, &g->ph, &g->pw, &g->dh, &g->dw};
    PyObject *seq = PySequence_Fast(geometry, "geometry must be a sequence of 13 integers");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != 13) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "geometry must be a sequence of 13 integers");
        return -1;
    }
    for (int i = 0; i < 13; i++) {
        *f[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (*f[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (g->kh * g->kw > 255 || g->sh < 1 || g->sw < 1 || g->dh < 1 || g->dw < 1 || g->oh < 0 || g->ow < 0) {
        PyErr_SetString(PyExc_ValueError, "unsupported pooling geometry");
        return -1;
    }
    return 0;
}

static PyObject *max_pool_forward(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *geometry, *ox, *oymax, *oy, *owin, *ocodes;
    pool_geometry g;
    buffers b = {.held = 0};
    void *x, *ymax, *y, *win, *codes;
    if (!PyArg_ParseTuple(args, "OOOOOO", &geometry, &ox, &oymax, &oy, &owin, &ocodes)) return NULL;
    if (parse_geometry(geometry, &g) < 0) return NULL;
    Py_ssize_t item = item_size(ox);
    if (item < 0) return NULL;
    Py_ssize_t ins = g.planes * g.h * g.w, outs = g.planes * g.oh * g.ow;
    if (take(&b, ox, 0, item, ins, "x", &x, 0) < 0 || take(&b, oymax, 1, item, outs, "ymax", &ymax, 0) < 0 ||
        take(&b, oy, 1, item, outs, "y", &y, 1) < 0 || take(&b, owin, 1, 1, outs, "winners", &win, 1) < 0 ||
        take(&b, ocodes, 0, 1, g.kh * g.kw, "codes", &codes, 0) < 0) {
        release(&b);
        return NULL;
    }
    pool_scan sc;
    if (scan_setup(&g, &sc) < 0) {
        release(&b);
        return PyErr_NoMemory();
    }
    Py_ssize_t phases = g.sh;
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
    Py_ssize_t item = item_size(ody);
    if (item < 0) return NULL;
    Py_ssize_t ins = g.planes * g.h * g.w, outs = g.planes * g.oh * g.ow;
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

static PyMethodDef methods[] = {
    {"max_pool_forward", max_pool_forward, METH_VARARGS,
     "max_pool_forward(geometry, x, ymax, y, winners, codes): 2-D MAX pooling of C-contiguous planes; y and "
     "winners may be None"},
    {"max_pool_backward", max_pool_backward, METH_VARARGS,
     "max_pool_backward(geometry, dy, ymax, winners, delta, dx, accumulate, positive): route each window's "
     "gradient to its winner"},
    {"lrn_forward", lrn_forward, METH_VARARGS,
     "lrn_forward(x, scale, y, n, c, hw, size, k, coeff): LRN across channels, beta 3/4"},
    {"lrn_backward", lrn_backward, METH_VARARGS,
     "lrn_backward(x, y, dy, scale, dx, n, c, hw, size, gain): its gradient, gain = -2*coeff*beta"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
