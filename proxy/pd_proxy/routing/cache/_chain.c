/* pd-proxy's block-key chain in C (pd_proxy.routing.cache.keys documents what a chain is).

The same contract as the Python chain in keys.py, with a different hash: each key mixes the
parent key, the block's token ids and the hash of its extra keys. Keys are only compared within
one process (the events index and the router call the same chain), so the two need not agree,
and keys.py uses this one whenever it is built. In Python the chain of an 8k-token prompt took
about 110 us (tuple per block, hash, a loop step per block): a third of a route at 32 replicas.
The module also holds the index's BlockTable (_block_table.c) and the check of a prompt's ids.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_block_table.h"

#define KEY_MASK ((UINT64_C(1) << 60) - 1)

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* One word into the running state (the multiply-rotate step of xxHash64's rounds). */
static inline uint64_t round64(uint64_t acc, uint64_t v) {
    acc += v * UINT64_C(0xC2B2AE3D27D4EB4F);
    acc = rotl(acc, 31);
    return acc * UINT64_C(0x9E3779B185EBCA87);
}

/* A token id as a word: its value when it fits in 64 bits, else Python's hash of it. */
static int token_word(PyObject *item, uint64_t *out) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1; /* not an int */
    }
    if (overflow) {
        Py_hash_t h = PyObject_Hash(item);
        if (h == -1 && PyErr_Occurred()) return -1;
        *out = (uint64_t)h ^ UINT64_C(0x5bd1e9955bd1e995);
        return 0;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Whether ``value`` is a list of JSON integers: every item exactly an int (a bool is not). The
   same answer as ``set(map(type, value)) <= {int}``, which took about 150 us for 8k ids (a set
   insertion per item) on every completions request whose prompt is ids. */
static PyObject *token_ids(PyObject *self, PyObject *value) {
    if (!PyList_Check(value)) Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(value);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(PyList_GET_ITEM(value, i))) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    PyObject *tokens, *extras = Py_None;
    Py_ssize_t block_size;
    unsigned long long parent;
    if (!PyArg_ParseTuple(args, "OnK|O", &tokens, &block_size, &parent, &extras)) return NULL;
    if (block_size < 1) {
        PyErr_SetString(PyExc_ValueError, "block_size must be at least 1");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints");
    if (seq == NULL) return NULL;
    PyObject *extra_seq = NULL;
    Py_ssize_t n_extra = 0;
    if (extras != Py_None) {
        extra_seq = PySequence_Fast(extras, "extras must be a sequence");
        if (extra_seq == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        n_extra = PySequence_Fast_GET_SIZE(extra_seq);
    }
    Py_ssize_t n_blocks = PySequence_Fast_GET_SIZE(seq) / block_size;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n_blocks);
    if (out == NULL) goto fail;
    uint64_t key = (uint64_t)parent;
    for (Py_ssize_t b = 0; b < n_blocks; b++) {
        uint64_t acc = key ^ UINT64_C(0x27D4EB2F165667C5);
        PyObject **block = items + b * block_size;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            uint64_t w;
            if (token_word(block[i], &w) < 0) goto fail;
            acc = round64(acc, w);
        }
        if (b < n_extra) {
            PyObject *extra = PySequence_Fast_GET_ITEM(extra_seq, b);
            if (extra != Py_None) {
                Py_hash_t h = PyObject_Hash(extra);
                if (h == -1 && PyErr_Occurred()) goto fail;
                acc = round64(acc ^ UINT64_C(0x165667B19E3779F9), (uint64_t)h);
            }
        }
        key = finish(acc + (uint64_t)block_size) & KEY_MASK;
        PyObject *k = PyLong_FromUnsignedLongLong(key);
        if (k == NULL) goto fail;
        PyList_SET_ITEM(out, b, k);
    }
    Py_DECREF(seq);
    Py_XDECREF(extra_seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    Py_XDECREF(extra_seq);
    return NULL;
}

/* The runs of equal values that ``held`` maps the leading ``keys`` to, up to the first key it
   lacks: a list of (value, run length). The walk of a role's index (holders.py) settles each
   replica's count per run; in Python its lookups and the list they filled were 28 us of a
   512-block prompt. Equal means the same object or equal ints (a mask shared by its slot). */
static PyObject *runs(PyObject *self, PyObject *args) {
    PyObject *held, *keys;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &held, &keys)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), length = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *current = NULL; /* borrowed from held: the dict is not changed meanwhile */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyDict_GetItemWithError(held, items[i]);
        if (value == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (current != NULL && value != current) {
            int same = PyObject_RichCompareBool(value, current, Py_EQ);
            if (same < 0) goto fail;
            if (!same) {
                PyObject *run = Py_BuildValue("(On)", current, length);
                if (run == NULL || PyList_Append(out, run) < 0) {
                    Py_XDECREF(run);
                    goto fail;
                }
                Py_DECREF(run);
                length = 0;
            }
        }
        current = value;
        length++;
    }
    if (current != NULL) {
        PyObject *run = Py_BuildValue("(On)", current, length);
        if (run == NULL || PyList_Append(out, run) < 0) {
            Py_XDECREF(run);
            goto fail;
        }
        Py_DECREF(run);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS,
     "chain(tokens, block_size, parent, extras=None) -> the keys of tokens' whole blocks"},
    {"token_ids", token_ids, METH_O, "token_ids(value) -> whether value is a list of ints only"},
    {"runs", runs, METH_VARARGS,
     "runs(held, keys) -> [(value, length)] of held's values for the leading keys it holds"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit__chain(void) {
    if (PyType_Ready(&BlockTableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&BlockTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(&BlockTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
