/* Batched memory copies for the CPU copy engine (kvstrata.connector.copy_engine).
 *
 * One call copies every row of a transfer: the engine computes the addresses (and checks
 * them against its KV cache and arena segments) in numpy, then hands the three arrays
 * over. A Python loop with one numpy copy per 32 KiB page spends as long in the
 * interpreter as in memcpy; this loop does not, and it releases the GIL so that several
 * threads can copy parts of one transfer at once.
 *
 * Optional: kvstrata falls back to numpy copies where this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int as_int64_array(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "l") != 0 && strcmp(view->format, "q") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_rows(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *size_obj;
    Py_buffer dst, src, size;
    if (!PyArg_ParseTuple(args, "OOO:copy_rows", &dst_obj, &src_obj, &size_obj))
        return NULL;
    if (as_int64_array(dst_obj, &dst, "dst") < 0)
        return NULL;
    if (as_int64_array(src_obj, &src, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (as_int64_array(size_obj, &size, "sizes") < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t rows = dst.len / 8;
    if (src.len / 8 != rows || size.len / 8 != rows) {
        PyErr_Format(PyExc_ValueError, "dst, src and sizes must have the same length (%zd, %zd, %zd)",
                     rows, src.len / 8, size.len / 8);
    } else {
        const int64_t *d = dst.buf, *s = src.buf, *n = size.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < rows; i++)
            memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)n[i]);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&size);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(dst, src, sizes): memcpy(dst[i], src[i], sizes[i]) for every i, without the GIL.\n"
     "Addresses are trusted: the caller checks them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
