/* The common case of a table's new row in C (Writes._append, so add_held, insert and a bag's
 * add): a small record written from the top of the small class's free stack and published in
 * the first empty index slot of the key's probe, its word 0.
 *
 * add_small(region, geometry, j, hash, kbytes, vbytes[, stores]) -> record number, or -1 when
 * the case is not the common one (table full, a large row, a damaged free stack, a stamp counter past its
 * bound, a probe without an empty slot, an offset past the region): then nothing was stored and
 * the caller takes the Python path, which handles (or repairs, or raises for) each of those.
 * A bucket version wraps at 2**64, as the Python path's (garbage only: 2**64 writes never
 * happen).
 * The stores are the Python path's, in its order (layout.py, writer.py); the caller holds the
 * registry lock. No Python code runs between the first store and the last, so no exception can
 * cut the write short and `lock.dirty` is not needed here; a process killed in between leaves
 * what a killed Python writer leaves, which fsck repairs.
 *
 * `stores` (tests only): make only the first `stores` of its stores and return -2, as a writer
 * killed there would leave the region (tests/shm/test_cwrite.py kills itself right after).
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

/* off + n * size <= len, none of it negative or overflowing */
static int fits(Py_ssize_t off, Py_ssize_t n, Py_ssize_t size, Py_ssize_t len) {
    Py_ssize_t span, end;
    return off >= 0 && n >= 0 && size >= 0 && !__builtin_mul_overflow(n, size, &span)
           && !__builtin_add_overflow(off, span, &end) && end <= len;
}

static PyObject *add_small(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_small takes 6 or 7 arguments");
        return NULL;
    }
    long limit = -1, done = 0; /* stores to make (-1: all), stores made */
    if (nargs == 7 && (limit = PyLong_AsLong(args[6])) == -1 && PyErr_Occurred())
        return NULL;
#define STORE(stmt) do { if (done++ == limit) goto stopped; stmt; } while (0)
    PyObject *geo = args[1];
    if (!PyTuple_CheckExact(geo) || PyTuple_GET_SIZE(geo) != NGEO
            || !PyBytes_CheckExact(args[4]) || !PyBytes_CheckExact(args[5])) {
        PyErr_SetString(PyExc_TypeError, "add_small: a geometry tuple and two bytes expected");
        return NULL;
    }
    /* heap offset, small record size, small payload, capacity, versions offset, index offset,
       free stacks offset, index slots */
    Py_ssize_t g[NGEO];
    for (int i = 0; i < NGEO; i++) {
        g[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(geo, i));
        if (g[i] < 0)
            return PyErr_Occurred() ? NULL : PyLong_FromLong(-1);
    }
    Py_ssize_t heap = g[0], ssize = g[1], spayload = g[2], cap = g[3], ver_off = g[4],
               idx_off = g[5], free_off = g[6], nslots = g[7];
    Py_ssize_t j = PyLong_AsSsize_t(args[2]);
    if (j < 0 && PyErr_Occurred())
        return NULL;
    unsigned long long h = PyLong_AsUnsignedLongLong(args[3]);
    if (h == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    const char *kb = PyBytes_AS_STRING(args[4]), *vb = PyBytes_AS_STRING(args[5]);
    Py_ssize_t kl = PyBytes_GET_SIZE(args[4]), vl = PyBytes_GET_SIZE(args[5]);

    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL; /* a released view: the table is closed */
    uint8_t *p = (uint8_t *)view.buf;
    Py_ssize_t len = view.len;
    long r = -1;
    if (((uintptr_t)p & 7) || h == 0 || nslots < 16 || nslots > (PY_SSIZE_T_MAX >> 5)
            || (nslots & (nslots - 1)) || j < 0 || j >= 2 * nslots || (j & 1)
            || cap >= PY_SSIZE_T_MAX || spayload > PY_SSIZE_T_MAX - REC_HEADER
            || kl + vl > spayload || REC_HEADER + spayload > ssize || !fits(0, 8, 8, len)
            || !fits(idx_off, nslots, 16, len) || !fits(ver_off, nslots / 16, 8, len)
            || !fits(free_off, cap + 1, 4, len) || !fits(heap, cap + 1, ssize, len)
            || (heap & 7) || (ssize & 7) || (idx_off & 7) || (ver_off & 7) || (free_off & 3))
        goto done;
    uint64_t *hq = (uint64_t *)p;
    uint64_t *ver = (uint64_t *)(p + ver_off);
    uint64_t *idx = (uint64_t *)(p + idx_off);
    uint32_t *freest = (uint32_t *)(p + free_off);
    uint64_t top = hq[HDR_TOP];
    uint64_t stamp = hq[HDR_STAMP]; /* + 1 below: a counter of 2**64 - 1 must not wrap to 0 */
    if (hq[HDR_ROWS] >= (uint64_t)cap || top == 0 || top > (uint64_t)cap + 1
            || stamp >= STAMP_MAX - 1)
        goto done;
    stamp += 1;
    uint32_t rec = freest[top - 1];
    if ((Py_ssize_t)rec > cap)
        goto done;
    Py_ssize_t s = j, wmask = 2 * nslots - 1, n;
    if (idx[s]) { /* the home slot is taken: the first empty one after it */
        for (n = 0; n < nslots; n++) {
            s = (s + 2) & wmask;
            if (!idx[s])
                break;
        }
        if (n == nslots)
            goto done;
    }

    uint8_t *rp = p + heap + (Py_ssize_t)rec * ssize;
    uint32_t seed = (uint32_t)((stamp ^ ((uint64_t)kl << 16) ^ (uint64_t)vl ^ SEED)
                               & 0xFFFFFFFFu);
    uint32_t crc = crc32_update(crc32_update(seed, (const uint8_t *)kb, (size_t)kl),
                                (const uint8_t *)vb, (size_t)vl);
    uint32_t lens[4] = {crc, (uint32_t)kl, (uint32_t)vl, 0};
    Py_ssize_t b = s >> 5;
    uint64_t v = __atomic_load_n(&ver[b], __ATOMIC_RELAXED);
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
    STORE(__atomic_store_n(&idx[s], (uint64_t)h, __ATOMIC_RELEASE));
    STORE(__atomic_store_n(&ver[b], v + 2, __ATOMIC_RELEASE));
    STORE(hq[HDR_ROWS] += 1);
    r = (long)rec;
    goto done;
stopped:
    r = -2;
done:
    PyBuffer_Release(&view);
    return PyLong_FromLong(r);
}

static PyMethodDef methods[] = {
    {"add_small", (PyCFunction)(void (*)(void))add_small, METH_FASTCALL,
     "add_small(region, geometry, j, hash, kbytes, vbytes[, stores]) -> record number, or -1 "
     "(nothing stored): see the module's source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmcancel.shm._cwrite",
    "The common case of a table's new small row, in C (see writer.py).", -1, methods,
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
