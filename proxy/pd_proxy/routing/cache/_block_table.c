/* BlockTable: one replica's vLLM block hash -> the proxy's key, in order of storing, in C
(pd_proxy.routing.cache.index keeps one per event stream; table.py has the Python fallback).

Both are ints below 2**64, so an entry is two words: 16 bytes in an array kept in order of
storing, plus a 4-byte slot of an open-addressing index over it. A Python dict of ints cost
about 41 bytes an entry plus a 32-byte int object for the hash: half of what an indexed
block-replica pair cost (142 bytes, tracemalloc). Memory comes from PyMem, so tracemalloc sees
it. The type holds no Python objects: the cyclic GC never visits it.

Entries removed leave a hole in the array (key DELETED) until the array is compacted; the bound
evicts from the front (``oldest``), which ``head`` keeps at the first entry still there.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_block_table.h"

#define DELETED UINT64_MAX /* an entry's key once removed (keys are below it) */
#define EMPTY 0u           /* a slot never used */
#define TOMB 1u            /* a slot whose entry was removed */
#define FIRST 2u           /* slot value of entry i: i + FIRST */
#define MIN_SLOTS 8

typedef struct {
    uint64_t hash;
    uint64_t key;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *entries;     /* in order of storing; removed ones hold DELETED */
    Py_ssize_t used;    /* entries written, holes included */
    Py_ssize_t alloc;   /* room in entries */
    Py_ssize_t head;    /* no live entry before it */
    Py_ssize_t live;    /* entries not removed */
    uint32_t *slots;    /* EMPTY, TOMB or entry + FIRST */
    Py_ssize_t nslots;  /* a power of two */
    Py_ssize_t filled;  /* slots not EMPTY */
} BlockTable;

/* An int below 2**64 - 1 as a word; -1 with an error set otherwise. */
static int as_word(PyObject *v, uint64_t *out) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "BlockTable holds ints, not %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    unsigned long long w = PyLong_AsUnsignedLongLong(v);
    if (w == DELETED) { /* also what a negative or too large int returns, its error replaced */
        PyErr_SetString(PyExc_OverflowError, "BlockTable holds ints from 0 to 2**64 - 2");
        return -1;
    }
    *out = (uint64_t)w;
    return 0;
}

/* The slot holding ``hash``, or (found == 0) the slot to store it in: the first tombstone met,
   else the empty slot that ended the probe. The hash is mixed first: vLLM's are random, but a
   test's may be 1, 2, 3. */
static Py_ssize_t probe(BlockTable *t, uint64_t hash, int *found) {
    size_t mask = (size_t)t->nslots - 1, i = (size_t)finish(hash) & mask;
    Py_ssize_t free_slot = -1;
    for (;;) {
        uint32_t s = t->slots[i];
        if (s == EMPTY) {
            *found = 0;
            return free_slot >= 0 ? free_slot : (Py_ssize_t)i;
        }
        if (s == TOMB) {
            if (free_slot < 0) free_slot = (Py_ssize_t)i;
        } else if (t->entries[s - FIRST].hash == hash) {
            *found = 1;
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* The slot of ``h``'s entry (``*found``) or where it would go; -1 with an error set when ``h`` is
   no int the table can hold. */
static Py_ssize_t lookup(BlockTable *t, PyObject *h, int *found) {
    uint64_t hash;
    if (as_word(h, &hash) < 0) return -1;
    return probe(t, hash, found);
}

/* Rebuild the index with the live entries moved to the array's front, in order; the index sized
   so that it is at most half full. On failure (no memory) nothing has changed. */
static int rebuild(BlockTable *t) {
    Py_ssize_t n = t->live, nslots = MIN_SLOTS;
    while (nslots < 2 * (n + 1)) nslots *= 2;
    uint32_t *slots = PyMem_Calloc((size_t)nslots, sizeof(uint32_t));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->nslots = nslots;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = t->head; i < t->used; i++) {
        if (t->entries[i].key != DELETED) t->entries[k++] = t->entries[i];
    }
    t->used = n;
    t->head = 0;
    if (t->alloc > 64 && t->alloc > 4 * n) { /* most were removed: give the room back */
        Entry *entries = PyMem_Realloc(t->entries, (size_t)(2 * n + 8) * sizeof(Entry));
        if (entries != NULL) {
            t->entries = entries;
            t->alloc = 2 * n + 8;
        }
    }
    size_t mask = (size_t)nslots - 1;
    for (Py_ssize_t e = 0; e < n; e++) {
        size_t i = (size_t)finish(t->entries[e].hash) & mask;
        while (slots[i] != EMPTY) i = (i + 1) & mask;
        slots[i] = (uint32_t)(e + FIRST);
    }
    t->filled = n;
    return 0;
}

static int store(BlockTable *t, uint64_t hash, uint64_t key) {
    int found;
    Py_ssize_t at = probe(t, hash, &found);
    if (found) {
        t->entries[t->slots[at] - FIRST].key = key; /* a dict's update: keeps its place */
        return 0;
    }
    if (t->used == t->alloc) {
        if (t->live * 4 < t->used * 3) {
            /* a quarter or more are holes: close them rather than grow */
            if (rebuild(t) < 0) return -1;
        } else {
            Py_ssize_t alloc = t->alloc < 8 ? 8 : t->alloc * 2;
            if ((size_t)alloc + FIRST > UINT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "BlockTable is full");
                return -1;
            }
            Entry *entries = PyMem_Realloc(t->entries, (size_t)alloc * sizeof(Entry));
            if (entries == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->entries = entries;
            t->alloc = alloc;
        }
        at = probe(t, hash, &found);
    }
    if ((t->filled + 1) * 3 > t->nslots * 2) {
        if (rebuild(t) < 0) return -1;
        at = probe(t, hash, &found);
    }
    if (t->slots[at] == EMPTY) t->filled++;
    t->slots[at] = (uint32_t)(t->used + FIRST);
    t->entries[t->used].hash = hash;
    t->entries[t->used].key = key;
    t->used++;
    t->live++;
    return 0;
}

/* Remove the entry in slot ``at``; its key. */
static uint64_t remove_at(BlockTable *t, Py_ssize_t at) {
    Py_ssize_t e = t->slots[at] - FIRST;
    uint64_t key = t->entries[e].key;
    t->entries[e].key = DELETED;
    t->slots[at] = TOMB;
    t->live--;
    if (t->live == 0) {
        t->used = t->head = t->filled = 0;
        memset(t->slots, 0, (size_t)t->nslots * sizeof(uint32_t));
    } else {
        while (t->entries[t->head].key == DELETED) t->head++;
        /* Seven in eight gone: close the holes and give the room back (amortised: the removals
           since the last rebuild pay for it). Without memory it stays as it is. */
        if (t->used > 256 && t->live * 8 < t->used && rebuild(t) < 0) PyErr_Clear();
    }
    return key;
}

static PyObject *table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "BlockTable() takes no arguments");
        return NULL;
    }
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->slots = PyMem_Calloc(MIN_SLOTS, sizeof(uint32_t));
    if (t->slots == NULL) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    t->nslots = MIN_SLOTS;
    return (PyObject *)t;
}

static void table_dealloc(BlockTable *t) {
    PyMem_Free(t->entries);
    PyMem_Free(t->slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t table_len(BlockTable *t) { return t->live; }

static int table_contains(BlockTable *t, PyObject *h) {
    int found;
    return lookup(t, h, &found) < 0 ? -1 : found;
}

static PyObject *table_subscript(BlockTable *t, PyObject *h) {
    int found;
    Py_ssize_t at = lookup(t, h, &found);
    if (at < 0) return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, h);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(t->entries[t->slots[at] - FIRST].key);
}

static int table_ass_subscript(BlockTable *t, PyObject *h, PyObject *value) {
    if (value != NULL) {
        uint64_t hash, key;
        if (as_word(h, &hash) < 0 || as_word(value, &key) < 0) return -1;
        return store(t, hash, key);
    }
    int found;
    Py_ssize_t at = lookup(t, h, &found);
    if (at < 0) return -1;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    remove_at(t, at);
    return 0;
}

/* get's and pop's (hash[, default]): the slot of hash (``*found``), or -1 with an error set. */
static Py_ssize_t find_arg(BlockTable *t, PyObject *const *args, Py_ssize_t nargs,
                           const char *name, int *found) {
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 1 or 2 arguments", name);
        return -1;
    }
    return lookup(t, args[0], found);
}

static PyObject *table_get(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    int found;
    Py_ssize_t at = find_arg(t, args, nargs, "get", &found);
    if (at < 0) return NULL;
    if (found) return PyLong_FromUnsignedLongLong(t->entries[t->slots[at] - FIRST].key);
    PyObject *fallback = nargs > 1 ? args[1] : Py_None;
    Py_INCREF(fallback);
    return fallback;
}

static PyObject *table_pop(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    int found;
    Py_ssize_t at = find_arg(t, args, nargs, "pop", &found);
    if (at < 0) return NULL;
    if (found) return PyLong_FromUnsignedLongLong(remove_at(t, at));
    if (nargs < 2) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_INCREF(args[1]);
    return args[1];
}

/* The first ``n`` entries still held, oldest first: their hashes, or (``keys``) their keys. */
static PyObject *live_words(BlockTable *t, Py_ssize_t n, int keys) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = t->head; k < n; i++) {
        if (t->entries[i].key == DELETED) continue;
        PyObject *w = PyLong_FromUnsignedLongLong(keys ? t->entries[i].key : t->entries[i].hash);
        if (w == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, w);
    }
    return out;
}

/* The first ``n`` hashes still held, oldest first (the bound evicts them). */
static PyObject *table_oldest(BlockTable *t, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n > t->live) n = t->live;
    if (n < 0) n = 0;
    return live_words(t, n, 0);
}

/* The keys held, oldest first (a list: the caller changes the table after reading them). */
static PyObject *table_values(BlockTable *t, PyObject *Py_UNUSED(ignored)) {
    return live_words(t, t->live, 1);
}

static PyObject *table_clear(BlockTable *t, PyObject *Py_UNUSED(ignored)) {
    PyMem_Free(t->entries);
    t->entries = NULL;
    t->alloc = t->used = t->head = t->live = t->filled = 0;
    uint32_t *slots = PyMem_Realloc(t->slots, MIN_SLOTS * sizeof(uint32_t));
    if (slots == NULL) return PyErr_NoMemory();
    t->slots = slots;
    t->nslots = MIN_SLOTS;
    memset(t->slots, 0, MIN_SLOTS * sizeof(uint32_t));
    Py_RETURN_NONE;
}

static PyObject *table_sizeof(BlockTable *t, PyObject *Py_UNUSED(ignored)) {
    size_t n = sizeof(BlockTable) + (size_t)t->alloc * sizeof(Entry) +
               (size_t)t->nslots * sizeof(uint32_t);
    return PyLong_FromSize_t(n);
}

static PyMethodDef table_methods[] = {
    {"get", (PyCFunction)(void (*)(void))table_get, METH_FASTCALL,
     "get(hash, default=None) -> the key stored under hash, or default"},
    {"pop", (PyCFunction)(void (*)(void))table_pop, METH_FASTCALL,
     "pop(hash[, default]) -> remove hash's entry, return its key (KeyError without default)"},
    {"oldest", (PyCFunction)table_oldest, METH_O, "oldest(n) -> the first n hashes, oldest first"},
    {"values", (PyCFunction)table_values, METH_NOARGS, "values() -> the keys, oldest first"},
    {"clear", (PyCFunction)table_clear, METH_NOARGS, "clear() -> remove every entry"},
    {"__sizeof__", (PyCFunction)table_sizeof, METH_NOARGS, "memory held, in bytes"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods table_as_sequence = {
    .sq_contains = (objobjproc)table_contains,
};

static PyMappingMethods table_as_mapping = {
    .mp_length = (lenfunc)table_len,
    .mp_subscript = (binaryfunc)table_subscript,
    .mp_ass_subscript = (objobjargproc)table_ass_subscript,
};

PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pd_proxy.routing.cache._chain.BlockTable",
    .tp_doc = "vLLM block hash -> the proxy's key, ints below 2**64, in order of storing",
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = table_new,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_as_sequence = &table_as_sequence,
    .tp_as_mapping = &table_as_mapping,
    .tp_methods = table_methods,
};
