/* The BlockTable type (_block_table.c), added to the _chain module by _chain.c. */
#ifndef PD_PROXY_BLOCK_TABLE_H
#define PD_PROXY_BLOCK_TABLE_H
#include <Python.h>
extern PyTypeObject BlockTableType;
#endif
