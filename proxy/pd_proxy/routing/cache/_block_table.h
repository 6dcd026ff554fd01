/* What the _chain module's two files share: the BlockTable type (_block_table.c), which
   _chain.c adds to the module, and splitmix64's finaliser, which both hash with. */
#ifndef PD_PROXY_BLOCK_TABLE_H
#define PD_PROXY_BLOCK_TABLE_H
#include <Python.h>
#include <stdint.h>

extern PyTypeObject BlockTableType;

/* splitmix64's finaliser: every input bit reaches every output bit. */
static inline uint64_t finish(uint64_t z) {
    z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
    return z ^ (z >> 31);
}
#endif
