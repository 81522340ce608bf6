/* The common cases of a table's writes in C: a new row (Writes._append, so add_held, insert and
 * a bag's add), a small record written from the top of the small class's free stack and
 * published in the first empty index slot of the key's probe, its word 0; and the removal of a
 * key's rows (Writes._delete) when each is a small record. Also the index hash (siphash).
 *
 * add_small(region, geometry, j, hash, kbytes, vbytes[, stores]) -> record number, or -1 when
 * the case is not the common one (table full, a large row, a damaged free stack, a stamp
 * counter past its bound, a probe without an empty slot, an offset past the region): then
 * nothing was stored and the caller takes the Python path, which handles (or repairs, or
 * raises for) each of those.
 *
 * delete_small(region, geometry, j, hash, kbytes[, stores[, scribble_word, scribble_value]])
 * -> rows removed, or -1 when the case is not the common one (a row of the key in a large
 * record, a record failing validation, a probe without an empty slot, more than MAX_FOUND
 * rows, a backward shift that could span more than MAX_SHIFT slots, an offset past the
 * region): then nothing was stored. Each row goes as Writes._delete_slot removes it
 * (backward shift, record freed), from the far end of the probe. -3: a shift found the index
 * changed under it (only another process writing without the lock does that) and stopped
 * part-way, leaving what a killed writer leaves; the caller
 * raises TableCorrupted, whose repair (fsck) restores a sound table.
 *
 * A bucket version wraps at 2**64, as the Python path's (garbage only: 2**64 writes never
 * happen).
 * The stores are the Python path's, in its order (layout.py, writer.py); the caller holds the
 * registry lock. No Python code runs between the first store and the last, so no exception can
 * cut the write short and `lock.dirty` is not needed here; a process killed in between leaves
 * what a killed Python writer leaves, which fsck repairs.
 *
 * `stores` (tests only): make only the first `stores` of its stores and return -2, as a writer
 * killed there would leave the region (tests/shm/test_cwrite.py kills itself right after).
 * delete_small's `scribble_word, scribble_value` (tests only): store that index word between
 * the probe and the first store, as another process writing without the lock could.
 *
 * siphash(key, data) -> int: SipHash-2-4 of data under the 16-byte key, the index hash of a
 * row's packed key (hashing.py, which has the same function in Python where this is not built).
 *
 * Memory ordering: every store into the index and the versions is an atomic store, and a
 * release fence orders the record and the odd version before the slot, the slot before the even
 * version: what the seqlock needs on any CPU (x86-64 gives it to plain stores already).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HDR_ROWS 3
#define HDR_TOP 4
#define HDR_STAMP 5
#define REC_HEADER 24
#define SEED 0x5EED5EEDu
#define STAMP_MAX (UINT64_C(1) << 62)
#define NGEO 8
#define MAX_FOUND 16   /* rows of one key delete_small removes (a set has one) */
#define MAX_SHIFT 1000 /* slots a backward shift may span: its buckets fit `marked` */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

/* zlib.crc32(data, seed): the CRC-32 of data continued from seed */
static uint32_t crc32_update(uint32_t seed, const uint8_t *p, size_t n) {
    uint32_t c = seed ^ 0xFFFFFFFFu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* SipHash-2-4 (Aumasson, Bernstein), its 64-bit result; whole words loaded as they lie (the
 * module is built only little-endian, see PyInit__cwrite), the tail byte by byte */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                           \
    do {                                                                                   \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                          \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                             \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                             \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                          \
    } while (0)

static uint64_t load_le(const uint8_t *p, size_t n) {
    uint64_t v = 0;
    while (n--)
        v = (v << 8) | p[n];
    return v;
}

static uint64_t siphash24(const uint8_t *k, const uint8_t *p, size_t n) {
    uint64_t k0, k1, m;
    memcpy(&k0, k, 8);
    memcpy(&k1, k + 8, 8);
    uint64_t v0 = k0 ^ UINT64_C(0x736f6d6570736575), v1 = k1 ^ UINT64_C(0x646f72616e646f6d);
    uint64_t v2 = k0 ^ UINT64_C(0x6c7967656e657261), v3 = k1 ^ UINT64_C(0x7465646279746573);
    size_t whole = n & ~(size_t)7;
    for (size_t i = 0; i < whole; i += 8) {
        memcpy(&m, p + i, 8);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t last = ((uint64_t)(n & 0xFF) << 56) | load_le(p + whole, n - whole);
    v3 ^= last;
    SIPROUND;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xFF;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

/* A record's crc seed: (stamp ^ klen << 16 ^ vlen ^ SEED) & 0xFFFFFFFF (layout.py's _SEED) */
static uint32_t record_seed(uint64_t stamp, uint64_t kl, uint64_t vl) {
    return (uint32_t)((stamp ^ (kl << 16) ^ vl ^ SEED) & 0xFFFFFFFFu);
}

/* off + n * size <= len, none of it negative or overflowing */
static int fits(Py_ssize_t off, Py_ssize_t n, Py_ssize_t size, Py_ssize_t len) {
    Py_ssize_t span, end;
    return off >= 0 && n >= 0 && size >= 0 && !__builtin_mul_overflow(n, size, &span)
           && !__builtin_add_overflow(off, span, &end) && end <= len;
}

/* A call's region (a writable view), table geometry, probe start and hash */
typedef struct {
    Py_buffer view;
    uint8_t *p;
    Py_ssize_t heap, ssize, spayload, cap, ver_off, idx_off, free_off, nslots, j;
    uint64_t h;
} Call;

/* Parse (region, geometry, j, hash, kbytes, ...): 1 with c->view held (release it), 0 when the
   geometry is not one this code can check (nothing held: the caller returns -1), -1 with an
   exception set. A geometry item below 0 is such a geometry; anything else is checked below. */
static int call_open(Call *c, const char *name, PyObject *const *args) {
    PyObject *geo = args[1];
    if (!PyTuple_CheckExact(geo) || PyTuple_GET_SIZE(geo) != NGEO
            || !PyBytes_CheckExact(args[4])) {
        PyErr_Format(PyExc_TypeError, "%s: a geometry tuple and bytes expected", name);
        return -1;
    }
    /* heap offset, small record size, small payload, capacity, versions offset, index offset,
       free stacks offset, index slots */
    Py_ssize_t g[NGEO];
    for (int i = 0; i < NGEO; i++) {
        g[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(geo, i));
        if (g[i] < 0)
            return PyErr_Occurred() ? -1 : 0;
    }
    c->heap = g[0], c->ssize = g[1], c->spayload = g[2], c->cap = g[3], c->ver_off = g[4],
    c->idx_off = g[5], c->free_off = g[6], c->nslots = g[7];
    c->j = PyLong_AsSsize_t(args[2]);
    if (c->j < 0 && PyErr_Occurred())
        return -1;
    unsigned long long h = PyLong_AsUnsignedLongLong(args[3]);
    if (h == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    c->h = h;
    if (PyObject_GetBuffer(args[0], &c->view, PyBUF_WRITABLE) < 0)
        return -1; /* a released view: the table is closed */
    c->p = (uint8_t *)c->view.buf;
    Py_ssize_t len = c->view.len, nslots = c->nslots, j = c->j, cap = c->cap;
    if (((uintptr_t)c->p & 7) || h == 0 || nslots < 16 || nslots > (PY_SSIZE_T_MAX >> 5)
            || (nslots & (nslots - 1)) || j < 0 || j >= 2 * nslots || (j & 1)
            || cap >= PY_SSIZE_T_MAX || c->spayload > PY_SSIZE_T_MAX - REC_HEADER
            || REC_HEADER + c->spayload > c->ssize || !fits(0, 8, 8, len)
            || !fits(c->idx_off, nslots, 16, len) || !fits(c->ver_off, nslots / 16, 8, len)
            || !fits(c->free_off, cap + 1, 4, len) || !fits(c->heap, cap + 1, c->ssize, len)
            || (c->heap & 7) || (c->ssize & 7) || (c->idx_off & 7) || (c->ver_off & 7)
            || (c->free_off & 3)) {
        PyBuffer_Release(&c->view);
        return 0;
    }
    return 1;
}

/* A call's end: the view released, ``r`` returned */
static PyObject *call_close(Call *c, long r) {
    PyBuffer_Release(&c->view);
    return PyLong_FromLong(r);
}

static int stores_limit(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t n, long *limit) {
    *limit = -1; /* stores to make (-1: all) */
    return nargs == n + 1 && (*limit = PyLong_AsLong(args[n])) == -1 && PyErr_Occurred();
}

#define STORE(stmt) do { if (done++ == limit) goto stopped; stmt; } while (0)
/* One read of a shared word: another process may write the segment meanwhile (a hostile one,
   or a bug), so a value checked is the value used, never read again by the compiler. */
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)

static PyObject *add_small(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_small takes 6 or 7 arguments");
        return NULL;
    }
    long limit, done = 0; /* stores to make (-1: all), stores made */
    if (stores_limit(args, nargs, 6, &limit))
        return NULL;
    if (!PyBytes_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "add_small: a geometry tuple and two bytes expected");
        return NULL;
    }
    Call c;
    int ok = call_open(&c, "add_small", args);
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    const char *kb = PyBytes_AS_STRING(args[4]), *vb = PyBytes_AS_STRING(args[5]);
    Py_ssize_t kl = PyBytes_GET_SIZE(args[4]), vl = PyBytes_GET_SIZE(args[5]);
    uint8_t *p = c.p;
    Py_ssize_t cap = c.cap, spayload = c.spayload, nslots = c.nslots;
    long r = -1;
    if (kl + vl > spayload)
        goto done;
    uint64_t *hq = (uint64_t *)p;
    uint64_t *ver = (uint64_t *)(p + c.ver_off);
    uint64_t *idx = (uint64_t *)(p + c.idx_off);
    uint32_t *freest = (uint32_t *)(p + c.free_off);
    uint64_t top = LOAD(hq[HDR_TOP]);
    uint64_t stamp = LOAD(hq[HDR_STAMP]); /* + 1 below: 2**64 - 1 must not wrap to 0 */
    if (LOAD(hq[HDR_ROWS]) >= (uint64_t)cap || top == 0 || top > (uint64_t)cap + 1
            || stamp >= STAMP_MAX - 1)
        goto done;
    stamp += 1;
    uint32_t rec = LOAD(freest[top - 1]);
    if ((Py_ssize_t)rec > cap)
        goto done;
    Py_ssize_t s = c.j, wmask = 2 * nslots - 1, n;
    if (LOAD(idx[s])) { /* the home slot is taken: the first empty one after it */
        for (n = 0; n < nslots; n++) {
            s = (s + 2) & wmask;
            if (!LOAD(idx[s]))
                break;
        }
        if (n == nslots)
            goto done;
    }

    uint8_t *rp = p + c.heap + (Py_ssize_t)rec * c.ssize;
    uint32_t seed = record_seed(stamp, (uint64_t)kl, (uint64_t)vl);
    uint32_t crc = crc32_update(crc32_update(seed, (const uint8_t *)kb, (size_t)kl),
                                (const uint8_t *)vb, (size_t)vl);
    uint32_t lens[4] = {crc, (uint32_t)kl, (uint32_t)vl, 0};
    Py_ssize_t b = s >> 5;
    uint64_t v = LOAD(ver[b]);
    STORE(hq[HDR_STAMP] = stamp);
    STORE(memcpy(rp, lens, 16));
    STORE(memcpy(rp + 16, &stamp, 8));
    STORE(memcpy(rp + REC_HEADER, kb, (size_t)kl));
    STORE(memcpy(rp + REC_HEADER + kl, vb, (size_t)vl));
    STORE(memset(rp + REC_HEADER + kl + vl, 0, (size_t)(spayload - kl - vl)));
    STORE(hq[HDR_TOP] = top - 1);
    STORE(__atomic_store_n(&ver[b], v + 1, __ATOMIC_RELAXED));
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the record and the odd version, then the slot */
    STORE(__atomic_store_n(&idx[s + 1], (uint64_t)rec, __ATOMIC_RELAXED));
    STORE(__atomic_store_n(&idx[s], c.h, __ATOMIC_RELEASE));
    STORE(__atomic_store_n(&ver[b], v + 2, __ATOMIC_RELEASE));
    STORE(hq[HDR_ROWS] = LOAD(hq[HDR_ROWS]) + 1);
    r = (long)rec;
    goto done;
stopped:
    r = -2;
done:
    return call_close(&c, r);
}

/* Whether small record rec (<= cap) passes Table._record's validation and holds key kb */
static int small_record_is(const Call *c, uint64_t rec, const char *kb, Py_ssize_t kl,
                           int *valid) {
    const uint8_t *rp = c->p + c->heap + (Py_ssize_t)rec * c->ssize;
    const uint64_t *hw = (const uint64_t *)rp; /* crc | kl, vl | word, stamp: 8-aligned */
    uint64_t w0 = LOAD(hw[0]), w1 = LOAD(hw[1]), stamp = LOAD(hw[2]);
    uint32_t lens[3] = {(uint32_t)w0, (uint32_t)(w0 >> 32), (uint32_t)w1};
    uint64_t n = (uint64_t)lens[1] + lens[2];
    *valid = 0;
    if (n > (uint64_t)c->spayload)
        return 0;
    if (crc32_update(record_seed(stamp, lens[1], lens[2]), rp + REC_HEADER, (size_t)n)
            != lens[0])
        return 0;
    *valid = 1;
    return (Py_ssize_t)lens[1] == kl && memcmp(rp + REC_HEADER, kb, (size_t)kl) == 0;
}

static PyObject *delete_small(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 5 && nargs != 6 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "delete_small takes 5, 6 or 8 arguments");
        return NULL;
    }
    long limit, done = 0;
    if (stores_limit(args, nargs < 6 ? nargs : 6, 5, &limit))
        return NULL;
    Py_ssize_t scribble = -1; /* tests only: the index word another process writes (below) */
    unsigned long long scribbled = 0;
    if (nargs == 8) {
        scribble = PyLong_AsSsize_t(args[6]);
        scribbled = PyLong_AsUnsignedLongLong(args[7]);
        if (PyErr_Occurred())
            return NULL;
    }
    Call c;
    int ok = call_open(&c, "delete_small", args);
    if (ok <= 0)
        return ok < 0 ? NULL : PyLong_FromLong(-1);
    const char *kb = PyBytes_AS_STRING(args[4]);
    Py_ssize_t kl = PyBytes_GET_SIZE(args[4]);
    uint8_t *p = c.p;
    Py_ssize_t cap = c.cap, nslots = c.nslots, mask = nslots - 1, wmask = 2 * nslots - 1;
    uint64_t *hq = (uint64_t *)p;
    uint64_t *ver = (uint64_t *)(p + c.ver_off);
    uint64_t *idx = (uint64_t *)(p + c.idx_off);
    uint32_t *freest = (uint32_t *)(p + c.free_off);
    long r = -1;

    /* Table._find: the key's rows in probe order, up to the empty slot that ends the probe */
    Py_ssize_t found[MAX_FOUND], nfound = 0, w = c.j, n;
    uint64_t recs[MAX_FOUND];
    for (n = 0; n < nslots; n++) {
        uint64_t sh = LOAD(idx[w]);
        if (!sh)
            break;
        if (sh == c.h) {
            uint64_t rec = LOAD(idx[w + 1]);
            int valid;
            if (rec > (uint64_t)cap) /* a large record, or a bad one: the Python path's */
                goto done;
            if (small_record_is(&c, rec, kb, kl, &valid)) {
                if (nfound == MAX_FOUND)
                    goto done;
                recs[nfound] = rec;
                found[nfound++] = w >> 1;
            } else if (!valid) {
                goto done; /* Python raises TableCorrupted (and the write repairs) */
            }
        }
        w = (w + 2) & wmask;
    }
    if (n == nslots)
        goto done;
    Py_ssize_t empty = w >> 1; /* every shift below ends at or before this slot, empty now */
    if (nfound && ((empty - found[0]) & mask) > MAX_SHIFT)
        goto done;
    if (scribble >= 0 && scribble < 2 * nslots) /* as another process would, right now */
        __atomic_store_n(&idx[scribble], (uint64_t)scribbled, __ATOMIC_RELAXED);

    /* Writes._delete_slot of each, from the far end */
    for (Py_ssize_t f = nfound - 1; f >= 0; f--) {
        Py_ssize_t s = found[f], i = s, jj = s, steps = ((empty - s) & mask) - 1;
        uint64_t rec = recs[f];
        Py_ssize_t marked[MAX_SHIFT / 16 + 4]; /* the buckets of the span (see MAX_SHIFT) */
        int nmarked = 0;
        marked[nmarked++] = s >> 4;
        STORE(__atomic_store_n(&ver[s >> 4], LOAD(ver[s >> 4]) + 1, __ATOMIC_RELAXED));
        __atomic_thread_fence(__ATOMIC_RELEASE); /* the odd version, then the slots */
        for (;;) {
            jj = (jj + 1) & mask;
            uint64_t hj = LOAD(idx[2 * jj]);
            if (!hj)
                break;
            /* Past the slot the probe found empty, or out of room to mark: another process
               wrote the index meanwhile. Stopped mid-shift (marked versions odd), the state a
               killed writer leaves: the caller raises TableCorrupted and the write repairs. */
            if (steps-- <= 0 || nmarked == (int)(sizeof marked / sizeof marked[0]))
                goto corrupt;
            Py_ssize_t k = (Py_ssize_t)(hj & (uint64_t)mask);
            /* the entry at jj stays if its home lies cyclically in (i, jj] */
            if (i <= jj ? (i < k && k <= jj) : (i < k || k <= jj))
                continue;
            Py_ssize_t bj = jj >> 4;
            int seen = 0;
            for (int m = 0; m < nmarked; m++)
                seen |= marked[m] == bj;
            if (!seen) {
                STORE(__atomic_store_n(&ver[bj], LOAD(ver[bj]) + 1, __ATOMIC_RELAXED));
                __atomic_thread_fence(__ATOMIC_RELEASE);
                marked[nmarked++] = bj;
            }
            STORE(__atomic_store_n(&idx[2 * i + 1], LOAD(idx[2 * jj + 1]), __ATOMIC_RELAXED));
            STORE(__atomic_store_n(&idx[2 * i], hj, __ATOMIC_RELAXED));
            i = jj;
        }
        STORE(__atomic_store_n(&idx[2 * i], 0, __ATOMIC_RELAXED));
        STORE(__atomic_store_n(&idx[2 * i + 1], 0, __ATOMIC_RELAXED));
        __atomic_thread_fence(__ATOMIC_RELEASE); /* the slots, then the even versions */
        for (int m = 0; m < nmarked; m++)
            STORE(__atomic_store_n(&ver[marked[m]], LOAD(ver[marked[m]]) + 1,
                                   __ATOMIC_RELAXED));
        uint64_t rows = LOAD(hq[HDR_ROWS]);
        if (rows) /* else the counter is garbage (check() recounts it); never store -1 */
            STORE(hq[HDR_ROWS] = rows - 1);
        uint64_t top = LOAD(hq[HDR_TOP]);
        if (top <= (uint64_t)cap) { /* else the stack is damaged; fsck rebuilds it */
            STORE(freest[top] = (uint32_t)rec);
            STORE(hq[HDR_TOP] = top + 1);
        }
    }
    r = (long)nfound;
    goto done;
corrupt:
    r = -3;
    goto done;
stopped:
    r = -2;
done:
    return call_close(&c, r);
}

static PyObject *siphash(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer key, data;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "siphash(key, data) takes exactly 2 arguments");
        return NULL;
    }
    if (PyBytes_CheckExact(args[0]) && PyBytes_CheckExact(args[1])
            && PyBytes_GET_SIZE(args[0]) == 16)  /* every call of the tables: no buffers */
        return PyLong_FromUnsignedLongLong(siphash24(
            (const uint8_t *)PyBytes_AS_STRING(args[0]),
            (const uint8_t *)PyBytes_AS_STRING(args[1]), (size_t)PyBytes_GET_SIZE(args[1])));
    if (PyObject_GetBuffer(args[0], &key, PyBUF_SIMPLE) < 0)
        return NULL;
    if (key.len != 16) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "siphash: the key is 16 bytes");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    uint64_t h = siphash24(key.buf, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"add_small", (PyCFunction)(void (*)(void))add_small, METH_FASTCALL,
     "add_small(region, geometry, j, hash, kbytes, vbytes[, stores]) -> record number, or -1 "
     "(nothing stored): see the module's source."},
    {"delete_small", (PyCFunction)(void (*)(void))delete_small, METH_FASTCALL,
     "delete_small(region, geometry, j, hash, kbytes[, stores]) -> rows removed, or -1 "
     "(nothing stored): see the module's source."},
    {"siphash", (PyCFunction)(void (*)(void))siphash, METH_FASTCALL,
     "siphash(key, data) -> SipHash-2-4 of data under the 16-byte key, an int."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmcancel.shm._cwrite",
    "The common cases of a table's writes, and the index hash, in C (writer.py, hashing.py).",
    -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cwrite(void) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    PyErr_SetString(PyExc_ImportError, "shmcancel.shm._cwrite: the layout is little-endian");
    return NULL;
#endif
    crc_init();
    return PyModule_Create(&module);
}
