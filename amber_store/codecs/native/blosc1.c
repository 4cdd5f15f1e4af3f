/* amber_store.codecs._blosc1: the native decoder (decode.c) and the lossless diff's host kernels
 * (zigzag.c) bound to Python. Frame headers and buffer sizes are read with the GIL held; the work
 * runs without it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "decode.h"
#include "zigzag.h"

/* The path named `name` (NULL: -1, the fastest), or -2 if it names none. */
static int path_named(const char *name) {
    if (!name) return -1;
    for (int p = 0; p < NPATHS; p++)
        if (!strcmp(name, PATH_NAMES[p])) return p;
    return -2;
}

static PyObject *py_takes(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"frame", "nbytes", "typesize", "path", NULL};
    Py_buffer frame;
    Py_ssize_t nbytes;
    int typesize = 0;
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n|iz", kwlist, &frame, &nbytes, &typesize, &name)) return NULL;
    header_t h;
    const int path = path_named(name);
    int ok = path > -2 && nbytes >= 0 && read_header(frame.buf, (size_t)frame.len, (size_t)nbytes, typesize, &h) &&
             path_for(path) >= 0;
    PyBuffer_Release(&frame);
    return PyBool_FromLong(ok);
}

static PyObject *py_path_for(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    const int named = path_named(name);
    const int path = named > -2 ? path_for(named) : -1;
    if (path < 0) Py_RETURN_NONE;
    return PyUnicode_FromString(PATH_NAMES[path]);
}

static PyObject *py_decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"frame", "out", "op", "path", NULL};
    Py_buffer frame, out;
    int op;
    const char *name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*i|z", kwlist, &frame, &out, &op, &name)) return NULL;
    const char *err = NULL;
    header_t h;
    int path = path_named(name);
    if (path == -2) {
        err = "unknown path";
    } else if (op != OP_STORE && op != OP_UNZIGZAG_ADD) {
        err = "unknown op";
    } else if (!read_header(frame.buf, (size_t)frame.len, (size_t)out.len, 0, &h)) {
        err = "not a frame this decoder takes";
    } else if ((path = path_for(path)) < 0) {
        err = "this CPU does not run that path";
    }
    uint8_t *tmp = err ? NULL : malloc(h.block);
    if (!err && !tmp) {
        PyBuffer_Release(&frame);
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    if (!err) {
        Py_BEGIN_ALLOW_THREADS
        err = decode(&h, frame.buf, (size_t)frame.len, out.buf, op, path, tmp);
        Py_END_ALLOW_THREADS
    }
    free(tmp);
    PyBuffer_Release(&frame);
    PyBuffer_Release(&out);
    if (err) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Buffers of `width`-byte elements (1, 2, 4, 8), each as long as the first and aligned to its
 * elements: what the kernels take, or a ValueError set. */
static int same_elements(Py_buffer *const bufs[], int count, int width) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "width must be 1, 2, 4 or 8");
        return 0;
    }
    for (int i = 0; i < count; i++) {
        if (bufs[i]->len != bufs[0]->len || bufs[i]->len % width || (uintptr_t)bufs[i]->buf % width) {
            PyErr_SetString(PyExc_ValueError, "buffers of one length, a whole number of elements, aligned to them");
            return 0;
        }
    }
    return 1;
}

static PyObject *py_zigzag_diff(PyObject *self, PyObject *args) {
    Py_buffer out, value, base;
    int width;
    if (!PyArg_ParseTuple(args, "w*y*y*i", &out, &value, &base, &width)) return NULL;
    Py_buffer *const bufs[] = {&out, &value, &base};
    const int ok = same_elements(bufs, 3, width);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        zigzag_diff(out.buf, value.buf, base.buf, (size_t)(out.len / width), width);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&value);
    PyBuffer_Release(&base);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_unzigzag_add(PyObject *self, PyObject *args) {
    Py_buffer out, stored;
    int width;
    if (!PyArg_ParseTuple(args, "w*y*i", &out, &stored, &width)) return NULL;
    Py_buffer *const bufs[] = {&out, &stored};
    const int ok = same_elements(bufs, 2, width);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        unzigzag_add(out.buf, stored.buf, (size_t)(out.len / width), width);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&stored);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"takes", (PyCFunction)(void (*)(void))py_takes, METH_VARARGS | METH_KEYWORDS,
     "takes(frame, nbytes, typesize=0, path=None) -> bool: whether decode() takes this frame for an "
     "output of nbytes (2- or 4-byte elements, typesize of them unless 0, bit-shuffled, lz4), by "
     "`path` (None: any this CPU runs)."},
    {"path_for", py_path_for, METH_VARARGS,
     "path_for(path=None) -> str | None: the path this CPU decodes by (`path`: that one, if it "
     "runs it), or None."},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(frame, out, op, path=None): decode the frame into the writable contiguous buffer out, "
     "op 0 storing the elements, op 1 adding their zigzag decoding (modulo the element's width) to "
     "out's, by `path` (one of `paths`; None: the fastest this CPU runs for the frame's elements). "
     "Raises ValueError on a frame it does not take or a corrupt one (out then holds partial data)."},
    {"zigzag_diff", py_zigzag_diff, METH_VARARGS,
     "zigzag_diff(out, value, base, width): out = zigzag(value - base) of unsigned ints of width "
     "(1, 2, 4, 8) bytes, modulo 2**(8 * width) (contiguous buffers of one length, aligned)."},
    {"unzigzag_add", py_unzigzag_add, METH_VARARGS,
     "unzigzag_add(out, stored, width): out += unzigzag(stored), modulo 2**(8 * width) "
     "(zigzag_diff's inverse)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blosc1", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blosc1(void) {
    decoder_init();
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *paths = PyTuple_New(0);
    for (int p = 0; paths && p < NPATHS; p++)
        if (runs[p]) {
            PyObject *name = PyUnicode_FromString(PATH_NAMES[p]);
            if (!name || _PyTuple_Resize(&paths, PyTuple_GET_SIZE(paths) + 1) < 0) {
                Py_XDECREF(name);
                Py_CLEAR(paths);
                break;
            }
            PyTuple_SET_ITEM(paths, PyTuple_GET_SIZE(paths) - 1, name);
        }
    if ((!paths || PyModule_AddIntConstant(m, "STORE", OP_STORE) < 0 ||
              PyModule_AddIntConstant(m, "UNZIGZAG_ADD", OP_UNZIGZAG_ADD) < 0 ||
              PyModule_AddObject(m, "paths", paths) < 0)) {
        Py_XDECREF(paths);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
