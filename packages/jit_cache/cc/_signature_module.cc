// Python bindings for signature.h: module jaxworks.jit_cache._signature.
//
// The four classes are plain CPython types whose objects hold the C++ object
// inline (PyBox<T>), with C slots for every operation: tp_call builds a
// signature or interns a context, tp_hash/tp_richcompare serve dictionary
// look-ups. A signature is built, and the trace context interned, on every
// inner jit call, and pybind11's generic dispatch (type look-ups by name,
// argument casters, its registry of instances) cost more than the work
// itself: through pybind11 classes a 2-leaf signature took ~1.1 us, interning
// ~0.6 us and a dict look-up ~160 ns; as plain types ~0.3 us, ~0.2 us and
// ~75 ns. pybind11 provides the module, RAII handles and errors.
//
// pybind11's per-incref GIL assertion off, as signature.h sets it, before any
// pybind11 header: the two translation units share pybind11's inline
// functions, and one with the assertion would put it back in both (it
// cost about a quarter of a signature's time).
#ifndef PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#define PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#endif

#include <pybind11/pybind11.h>
#include <structmember.h>

#include <cstddef>
#include <exception>
#include <new>
#include <string>

#include "signature.h"

namespace py = pybind11;
using jaxworks::jit_cache::ContextInterner;
using jaxworks::jit_cache::ContextKey;
using jaxworks::jit_cache::LeafKindName;
using jaxworks::jit_cache::PyBox;
using jaxworks::jit_cache::Signature;
using jaxworks::jit_cache::SignatureBuilder;

namespace {

// Types created at module import: builders make Signatures, interners make
// ContextKeys. (A module initialised once per process, like every pybind11
// module.)
PyTypeObject* g_signature_type = nullptr;
PyTypeObject* g_context_key_type = nullptr;
PyTypeObject* g_forwarder_type = nullptr;

// Runs `f`; a C++ exception becomes the matching Python error and `on_error`
// is returned (slots must not let exceptions escape into CPython).
template <typename R, typename F>
R Guard(R on_error, F&& f) {
  try {
    return f();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return on_error;
}

// The C++ object of `self`, or nullptr with a TypeError (an object that was
// never initialised; not reachable through the public constructors).
template <typename T>
T* Unbox(PyObject* self) {
  T* value = PyBox<T>::Get(self);
  if (value == nullptr) {
    PyErr_SetString(PyExc_TypeError, "uninitialised jit_cache object");
  }
  return value;
}

// -------------------------------------------------------- generic slots

template <typename T>
void Dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  reinterpret_cast<PyBox<T>*>(self)->value.~optional();
  type->tp_free(self);
  Py_DECREF(type);  // heap types: each object holds a reference to its type
}

template <typename T>
int Traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));
  const T* value = PyBox<T>::Get(self);
  return value == nullptr ? 0 : value->Traverse(visit, arg);
}

template <typename T>
int Clear(PyObject* self) {
  if (T* value = PyBox<T>::Get(self)) value->Clear();
  return 0;
}

Py_hash_t ToPyHash(size_t h) {
  Py_hash_t out = static_cast<Py_hash_t>(h);
  return out == -1 ? -2 : out;  // -1 is reserved for errors
}

template <typename T>
Py_hash_t Hash(PyObject* self) {
  const T* value = Unbox<T>(self);
  return value == nullptr ? -1 : ToPyHash(value->hash());
}

// == and != with objects of the same type; NotImplemented otherwise.
template <typename T>
PyObject* RichCompare(PyObject* self, PyObject* other, int op) {
  const T* a = PyBox<T>::Get(self);
  const T* b = Py_TYPE(other) == Py_TYPE(self) ? PyBox<T>::Get(other) : nullptr;
  if ((op != Py_EQ && op != Py_NE) || a == nullptr || b == nullptr) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  return Guard<PyObject*>(
      nullptr, [&] { return PyBool_FromLong((op == Py_EQ) == a->Equals(*b)); });
}

// Unpacks (first[, second]) positional-or-keyword arguments of a tp_call
// slot; positional arguments only take the fast path.
bool UnpackOneOrTwo(const char* what, PyObject* args, PyObject* kwargs,
                    const char* first_name, const char* second_name,
                    PyObject** first, PyObject** second) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (kwargs == nullptr && (n == 1 || n == 2)) {
    *first = PyTuple_GET_ITEM(args, 0);
    if (n == 2) *second = PyTuple_GET_ITEM(args, 1);
    return true;
  }
  std::string format = std::string("O|O:") + what;
  char* names[] = {const_cast<char*>(first_name),
                   const_cast<char*>(second_name), nullptr};
  return PyArg_ParseTupleAndKeywords(args, kwargs, format.c_str(), names, first,
                                     second) != 0;
}

// ----------------------------------------------------------- Signature

PyObject* SignatureRepr(PyObject* self) {
  const Signature* sig = Unbox<Signature>(self);
  if (sig == nullptr) return nullptr;
  return PyUnicode_FromString(sig->Repr().c_str());
}

Py_ssize_t SignatureLen(PyObject* self) {
  const Signature* sig = Unbox<Signature>(self);
  return sig == nullptr ? -1 : static_cast<Py_ssize_t>(sig->size());
}

PyObject* SignatureExtra(PyObject* self, void*) {
  const Signature* sig = Unbox<Signature>(self);
  if (sig == nullptr) return nullptr;
  PyObject* extra = sig->extra() ? sig->extra().ptr() : Py_None;
  Py_INCREF(extra);
  return extra;
}

PyObject* SignatureHasTracer(PyObject* self, void*) {
  const Signature* sig = Unbox<Signature>(self);
  if (sig == nullptr) return nullptr;
  return PyBool_FromLong(sig->has_tracer());
}

PyObject* SignatureDescribe(PyObject* self, PyObject*) {
  const Signature* sig = Unbox<Signature>(self);
  if (sig == nullptr) return nullptr;
  return Guard<PyObject*>(nullptr,
                          [&] { return sig->Describe().release().ptr(); });
}

PyGetSetDef signature_getset[] = {
    {"extra", SignatureExtra, nullptr,
     "The extra object (tree structure, statics, context).", nullptr},
    {"has_tracer", SignatureHasTracer, nullptr, "True when a leaf is a tracer.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyMethodDef signature_methods[] = {
    {"describe", SignatureDescribe, METH_NOARGS,
     "One (kind, first, second, committed) tuple per leaf."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot signature_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("Signature of one call's flattened arguments; built by "
                       "SignatureBuilder, hash precomputed.")},
    {Py_tp_dealloc, reinterpret_cast<void*>(Dealloc<Signature>)},
    {Py_tp_traverse, reinterpret_cast<void*>(Traverse<Signature>)},
    {Py_tp_clear, reinterpret_cast<void*>(Clear<Signature>)},
    {Py_tp_hash, reinterpret_cast<void*>(Hash<Signature>)},
    {Py_tp_richcompare, reinterpret_cast<void*>(RichCompare<Signature>)},
    {Py_tp_repr, reinterpret_cast<void*>(SignatureRepr)},
    {Py_sq_length, reinterpret_cast<void*>(SignatureLen)},
    {Py_tp_getset, signature_getset},
    {Py_tp_methods, signature_methods},
    {0, nullptr}};

// ---------------------------------------------------- SignatureBuilder

PyObject* BuilderNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyObject *array_types, *tracer_type, *ndarray_type, *generic_type, *fallback;
  PyObject* array_samples = Py_None;
  PyObject* flatten = Py_None;
  char* names[] = {const_cast<char*>("array_types"),
                   const_cast<char*>("tracer_type"),
                   const_cast<char*>("ndarray_type"),
                   const_cast<char*>("numpy_generic_type"),
                   const_cast<char*>("fallback"),
                   const_cast<char*>("array_samples"),
                   const_cast<char*>("flatten"),
                   nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!OOOO|OO:SignatureBuilder",
                                   names, &PyTuple_Type, &array_types,
                                   &tracer_type, &ndarray_type, &generic_type,
                                   &fallback, &array_samples, &flatten)) {
    return nullptr;
  }
  return Guard<PyObject*>(nullptr, [&]() -> PyObject* {
    auto borrow = [](PyObject* o) {
      return py::reinterpret_borrow<py::object>(o);
    };
    SignatureBuilder builder(py::reinterpret_borrow<py::tuple>(array_types),
                             borrow(tracer_type), borrow(ndarray_type),
                             borrow(generic_type), borrow(fallback),
                             borrow(array_samples), borrow(flatten));
    return PyBox<SignatureBuilder>::New(type, std::move(builder));
  });
}

// builder(leaves, extra=None) -> Signature
PyObject* BuilderCall(PyObject* self, PyObject* args, PyObject* kwargs) {
  const SignatureBuilder* builder = Unbox<SignatureBuilder>(self);
  PyObject* leaves = nullptr;
  PyObject* extra = Py_None;
  if (builder == nullptr ||
      !UnpackOneOrTwo("SignatureBuilder.__call__", args, kwargs, "leaves",
                      "extra", &leaves, &extra)) {
    return nullptr;
  }
  return Guard<PyObject*>(nullptr, [&] {
    // Built completely before the Python object exists (building may run
    // Python code, and with it the garbage collector).
    Signature sig =
        builder->Build(leaves, py::reinterpret_borrow<py::object>(extra));
    return PyBox<Signature>::New(g_signature_type, std::move(sig));
  });
}

// builder.key(tree, statics, ctx) -> (leaves, treedef, Signature)
PyObject* BuilderKey(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  const SignatureBuilder* builder = Unbox<SignatureBuilder>(self);
  if (builder == nullptr) return nullptr;
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError,
                 "SignatureBuilder.key(tree, statics, ctx) takes 3 "
                 "arguments, got %zd",
                 nargs);
    return nullptr;
  }
  return Guard<PyObject*>(nullptr, [&]() -> PyObject* {
    auto borrow = [](PyObject* o) {
      return py::reinterpret_borrow<py::object>(o);
    };
    SignatureBuilder::KeyResult key =
        builder->Key(args[0], borrow(args[1]), borrow(args[2]));
    PyObject* sig =
        PyBox<Signature>::New(g_signature_type, std::move(key.signature));
    if (sig == nullptr) return nullptr;
    return PyTuple_Pack(3, key.leaves.ptr(), key.treedef.ptr(),
                        py::reinterpret_steal<py::object>(sig).ptr());
  });
}

PyObject* BuilderClassify(PyObject* self, PyObject* leaf) {
  const SignatureBuilder* builder = Unbox<SignatureBuilder>(self);
  if (builder == nullptr) return nullptr;
  return PyUnicode_FromString(LeafKindName(builder->Classify(leaf)));
}

PyObject* BuilderReadsArrayFields(PyObject* self, PyObject*) {
  const SignatureBuilder* builder = Unbox<SignatureBuilder>(self);
  if (builder == nullptr) return nullptr;
  return PyBool_FromLong(builder->ReadsArrayFields());
}

PyMethodDef builder_methods[] = {
    {"reads_array_fields", BuilderReadsArrayFields, METH_NOARGS,
     "True when jax Arrays are read from their fields (not their getters)."},
    {"classify", BuilderClassify, METH_O,
     "classify(leaf): the leaf kind name, without calling the fallback."},
    {"key", reinterpret_cast<PyCFunction>(BuilderKey), METH_FASTCALL,
     "key(tree, statics, ctx): (leaves, treedef, Signature) of a call's "
     "dynamic arguments `tree`, as flatten(tree) and builder(leaves, "
     "(treedef, statics, ctx)) give them."},
    {nullptr, nullptr, 0, nullptr}};

PyType_Slot builder_slots[] = {
    {Py_tp_doc, const_cast<char*>(
                    "SignatureBuilder(array_types, tracer_type, ndarray_type, "
                    "numpy_generic_type, fallback)\n\nCalled as "
                    "builder(leaves, extra=None): the Signature of a list or "
                    "tuple of leaves plus one hashable extra object.")},
    {Py_tp_new, reinterpret_cast<void*>(BuilderNew)},
    {Py_tp_call, reinterpret_cast<void*>(BuilderCall)},
    {Py_tp_dealloc, reinterpret_cast<void*>(Dealloc<SignatureBuilder>)},
    {Py_tp_traverse, reinterpret_cast<void*>(Traverse<SignatureBuilder>)},
    {Py_tp_clear, reinterpret_cast<void*>(Clear<SignatureBuilder>)},
    {Py_tp_methods, builder_methods},
    {0, nullptr}};

// ---------------------------------------------------------- ContextKey

PyObject* ContextKeyValues(PyObject* self, void*) {
  const ContextKey* key = Unbox<ContextKey>(self);
  if (key == nullptr) return nullptr;
  return py::object(key->values()).release().ptr();
}

PyObject* ContextKeyRepr(PyObject* self) {
  const ContextKey* key = Unbox<ContextKey>(self);
  if (key == nullptr) return nullptr;
  return PyUnicode_FromFormat("ContextKey(%zd values)",
                              PyTuple_GET_SIZE(key->values().ptr()));
}

PyGetSetDef context_key_getset[] = {
    {"values", ContextKeyValues, nullptr, "The interned tuple.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot context_key_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("A tuple with a cached hash; made by ContextInterner.")},
    {Py_tp_dealloc, reinterpret_cast<void*>(Dealloc<ContextKey>)},
    {Py_tp_traverse, reinterpret_cast<void*>(Traverse<ContextKey>)},
    {Py_tp_clear, reinterpret_cast<void*>(Clear<ContextKey>)},
    {Py_tp_hash, reinterpret_cast<void*>(Hash<ContextKey>)},
    {Py_tp_richcompare, reinterpret_cast<void*>(RichCompare<ContextKey>)},
    {Py_tp_repr, reinterpret_cast<void*>(ContextKeyRepr)},
    {Py_tp_getset, context_key_getset},
    {0, nullptr}};

// ----------------------------------------------------- ContextInterner

PyObject* InternerNew(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  Py_ssize_t capacity = 8;
  char* names[] = {const_cast<char*>("capacity"), nullptr};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|n:ContextInterner", names,
                                   &capacity)) {
    return nullptr;
  }
  if (capacity < 0) {
    PyErr_Format(PyExc_ValueError,
                 "ContextInterner: capacity must be >= 0, got %zd", capacity);
    return nullptr;
  }
  return Guard<PyObject*>(nullptr, [&] {
    ContextInterner interner(static_cast<size_t>(capacity), g_context_key_type);
    return PyBox<ContextInterner>::New(type, std::move(interner));
  });
}

// interner(values) -> ContextKey
PyObject* InternerCall(PyObject* self, PyObject* args, PyObject* kwargs) {
  ContextInterner* interner = Unbox<ContextInterner>(self);
  PyObject* values = nullptr;
  if (interner == nullptr) return nullptr;
  if (kwargs != nullptr || PyTuple_GET_SIZE(args) != 1) {
    char* names[] = {const_cast<char*>("values"), nullptr};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:ContextInterner.__call__",
                                     names, &values)) {
      return nullptr;
    }
  } else {
    values = PyTuple_GET_ITEM(args, 0);
  }
  return Guard<PyObject*>(
      nullptr, [&] { return interner->Intern(values).release().ptr(); });
}

Py_ssize_t InternerLen(PyObject* self) {
  const ContextInterner* interner = Unbox<ContextInterner>(self);
  return interner == nullptr ? -1 : static_cast<Py_ssize_t>(interner->size());
}

PyType_Slot interner_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("ContextInterner(capacity=8)\n\nCalled as "
                       "interner(values): the same ContextKey for tuples whose "
                       "elements are identical to one of the last `capacity` "
                       "tuples seen.")},
    {Py_tp_new, reinterpret_cast<void*>(InternerNew)},
    {Py_tp_call, reinterpret_cast<void*>(InternerCall)},
    {Py_tp_dealloc, reinterpret_cast<void*>(Dealloc<ContextInterner>)},
    {Py_tp_traverse, reinterpret_cast<void*>(Traverse<ContextInterner>)},
    {Py_tp_clear, reinterpret_cast<void*>(Clear<ContextInterner>)},
    {Py_sq_length, reinterpret_cast<void*>(InternerLen)},
    {0, nullptr}};

// ------------------------------------------------------------ Forwarder
//
// The base type of JitFunction. Calling an instance forwards the call, in C
// and with the caller's argument vector, to its target (the function's C++
// dispatcher): a cached call runs no Python frame of jit_cache, as a call of
// stock jax.jit's wrapper runs none. When the target raises an Exception, the
// error hook may replace it: on_error(self, error, args, kwargs) returns an
// exception to raise instead (chained from the original) or None.

struct ForwarderObject {
  PyObject_HEAD vectorcallfunc vectorcall;
  PyObject* target;
  PyObject* on_error;
  // Calls whose first argument is an instance of `tracer_type` (a call under
  // a trace, which the dispatcher would hand to Python anyway) go to
  // `traced` instead of `target`; both null when not set.
  PyObject* traced;
  PyObject* tracer_type;
};

// The error hook's turn: the error is set on entry; on return one is set.
void ForwarderOnError(ForwarderObject* self, PyObject* const* args,
                      Py_ssize_t nargs, PyObject* kwnames) {
  if (self->on_error == nullptr || !PyErr_ExceptionMatches(PyExc_Exception)) {
    return;
  }
  PyObject *type, *error, *tb;
  PyErr_Fetch(&type, &error, &tb);
  PyErr_NormalizeException(&type, &error, &tb);
  if (tb != nullptr) PyException_SetTraceback(error, tb);
  PyObject* replacement = nullptr;
  PyObject* tuple = PyTuple_New(nargs);
  PyObject* kwargs = PyDict_New();
  bool built = tuple != nullptr && kwargs != nullptr;
  for (Py_ssize_t i = 0; built && i < nargs; ++i) {
    Py_INCREF(args[i]);
    PyTuple_SET_ITEM(tuple, i, args[i]);
  }
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t i = 0; built && i < nkw; ++i) {
    built = PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i),
                           args[nargs + i]) == 0;
  }
  if (built) {
    PyObject* hook = self->on_error;
    Py_INCREF(hook);  // the hook may rebind it
    replacement = PyObject_CallFunctionObjArgs(
        hook, reinterpret_cast<PyObject*>(self), error, tuple, kwargs, nullptr);
    Py_DECREF(hook);
  }
  Py_XDECREF(tuple);
  Py_XDECREF(kwargs);
  if (replacement == nullptr) {
    // The hook (or building its arguments) failed: that error, chained.
    PyObject *t2, *e2, *tb2;
    PyErr_Fetch(&t2, &e2, &tb2);
    PyErr_NormalizeException(&t2, &e2, &tb2);
    if (tb2 != nullptr) PyException_SetTraceback(e2, tb2);
    PyException_SetContext(e2, error);  // steals error
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyErr_Restore(t2, e2, tb2);
    return;
  }
  if (replacement == Py_None || !PyExceptionInstance_Check(replacement)) {
    Py_DECREF(replacement);
    PyErr_Restore(type, error, tb);
    return;
  }
  // `raise replacement from error`, unless the hook chained it already.
  PyObject* cause = PyException_GetCause(replacement);
  if (cause == nullptr) {
    Py_INCREF(error);
    PyException_SetCause(replacement, error);  // steals
  }
  Py_XDECREF(cause);
  PyObject* context = PyException_GetContext(replacement);
  if (context == nullptr) {
    PyException_SetContext(replacement, error);  // steals
  } else {
    Py_DECREF(error);
  }
  Py_XDECREF(context);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(replacement)),
                  replacement);
  Py_DECREF(replacement);
}

PyObject* ForwarderVectorcall(PyObject* callable, PyObject* const* args,
                              size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<ForwarderObject*>(callable);
  PyObject* target = self->target;
  if (target == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s object is not initialised",
                 Py_TYPE(callable)->tp_name);
    return nullptr;
  }
  if (self->traced != nullptr && PyVectorcall_NARGS(nargsf) > 0 &&
      PyObject_TypeCheck(args[0],
                         reinterpret_cast<PyTypeObject*>(self->tracer_type))) {
    target = self->traced;
  }
  Py_INCREF(target);  // the call may rebind it
  PyObject* result = PyObject_Vectorcall(target, args, nargsf, kwnames);
  Py_DECREF(target);
  if (result == nullptr) {
    ForwarderOnError(self, args, PyVectorcall_NARGS(nargsf), kwnames);
  }
  return result;
}

PyObject* ForwarderNew(PyTypeObject* type, PyObject*, PyObject*) {
  PyObject* self = type->tp_alloc(type, 0);
  if (self != nullptr) {
    reinterpret_cast<ForwarderObject*>(self)->vectorcall = ForwarderVectorcall;
  }
  return self;
}

int ForwarderTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* f = reinterpret_cast<ForwarderObject*>(self);
  Py_VISIT(Py_TYPE(self));
  Py_VISIT(f->target);
  Py_VISIT(f->on_error);
  Py_VISIT(f->traced);
  Py_VISIT(f->tracer_type);
  return 0;
}

int ForwarderClear(PyObject* self) {
  auto* f = reinterpret_cast<ForwarderObject*>(self);
  Py_CLEAR(f->target);
  Py_CLEAR(f->on_error);
  Py_CLEAR(f->traced);
  Py_CLEAR(f->tracer_type);
  return 0;
}

void ForwarderDealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  PyObject_GC_UnTrack(self);
  ForwarderClear(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// Replaces *slot by `value` (a new reference, or null for None).
void Rebind(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  *slot = value == Py_None ? nullptr : (Py_INCREF(value), value);
  Py_XDECREF(old);
}

// self._forward_to(target, on_error[, traced, tracer_type]): where calls go,
// the error hook (None for none), and where calls with a tracer first go.
PyObject* ForwarderForwardTo(PyObject* self, PyObject* const* args,
                             Py_ssize_t nargs) {
  if (nargs != 2 && nargs != 4) {
    PyErr_Format(PyExc_TypeError,
                 "_forward_to(target, on_error[, traced, tracer_type]) takes "
                 "2 or 4 arguments, got %zd",
                 nargs);
    return nullptr;
  }
  PyObject* traced = nargs == 4 ? args[2] : Py_None;
  PyObject* tracer_type = nargs == 4 ? args[3] : Py_None;
  if (!PyCallable_Check(args[0]) ||
      (args[1] != Py_None && !PyCallable_Check(args[1])) ||
      (traced != Py_None && !PyCallable_Check(traced)) ||
      (traced == Py_None) != (tracer_type == Py_None) ||
      (tracer_type != Py_None && !PyType_Check(tracer_type))) {
    PyErr_SetString(PyExc_TypeError,
                    "_forward_to: target must be callable, on_error callable "
                    "or None, traced callable and tracer_type a type (or both "
                    "None)");
    return nullptr;
  }
  auto* f = reinterpret_cast<ForwarderObject*>(self);
  Py_INCREF(args[0]);
  PyObject* old_target = f->target;
  f->target = args[0];
  Py_XDECREF(old_target);
  Rebind(&f->on_error, args[1]);
  Rebind(&f->traced, traced);
  Rebind(&f->tracer_type, tracer_type);
  Py_RETURN_NONE;
}

PyMethodDef forwarder_methods[] = {
    {"_forward_to", reinterpret_cast<PyCFunction>(ForwarderForwardTo),
     METH_FASTCALL,
     "_forward_to(target, on_error[, traced, tracer_type]): calls go to "
     "target (to traced when the first argument is a tracer_type); "
     "on_error(self, error, args, kwargs) may return an exception to raise "
     "instead."},
    {nullptr, nullptr, 0, nullptr}};

PyMemberDef forwarder_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET,
     static_cast<Py_ssize_t>(offsetof(ForwarderObject, vectorcall)), READONLY,
     nullptr},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot forwarder_slots[] = {
    {Py_tp_doc, const_cast<char*>(
                    "Forwarder()\n\nBase type whose instances forward calls, "
                    "in C, to the target set by _forward_to.")},
    {Py_tp_new, reinterpret_cast<void*>(ForwarderNew)},
    {Py_tp_call, reinterpret_cast<void*>(PyVectorcall_Call)},
    {Py_tp_dealloc, reinterpret_cast<void*>(ForwarderDealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(ForwarderTraverse)},
    {Py_tp_clear, reinterpret_cast<void*>(ForwarderClear)},
    {Py_tp_methods, forwarder_methods},
    {Py_tp_members, forwarder_members},
    {0, nullptr}};

PyType_Spec forwarder_spec = {"jaxworks.jit_cache._signature.Forwarder",
                              static_cast<int>(sizeof(ForwarderObject)), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
                                  Py_TPFLAGS_BASETYPE |
                                  Py_TPFLAGS_HAVE_VECTORCALL,
                              forwarder_slots};

// enable_vectorcall(cls): the vectorcall protocol for a Python subclass of
// Forwarder that does not define __call__ (CPython >= 3.12 passes it on by
// itself; 3.11 gives it only to static types, so calls would first pack a
// tuple and a dict).
PyObject* EnableVectorcall(PyObject*, PyObject* cls) {
  if (!PyType_Check(cls) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls),
                        g_forwarder_type)) {
    PyErr_SetString(PyExc_TypeError,
                    "enable_vectorcall: expected a subclass of Forwarder");
    return nullptr;
  }
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  if (type->tp_call != PyVectorcall_Call) Py_RETURN_FALSE;  // __call__ set
  type->tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL;
  Py_RETURN_TRUE;
}

PyMethodDef module_functions[] = {
    {"enable_vectorcall", EnableVectorcall, METH_O,
     "enable_vectorcall(cls): vectorcall for a Forwarder subclass without "
     "__call__; returns whether it is on."},
    {nullptr, nullptr, 0, nullptr}};

// Final (no subclasses), garbage-collected types; the two key types cannot
// be instantiated from Python.
template <typename T>
PyType_Spec Spec(const char* name, PyType_Slot* slots, bool instantiable) {
  unsigned int flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  if (!instantiable) flags |= Py_TPFLAGS_DISALLOW_INSTANTIATION;
  return PyType_Spec{name, static_cast<int>(sizeof(PyBox<T>)), 0, flags, slots};
}

PyType_Spec signature_spec = Spec<Signature>(
    "jaxworks.jit_cache._signature.Signature", signature_slots, false);
PyType_Spec builder_spec = Spec<SignatureBuilder>(
    "jaxworks.jit_cache._signature.SignatureBuilder", builder_slots, true);
PyType_Spec context_key_spec = Spec<ContextKey>(
    "jaxworks.jit_cache._signature.ContextKey", context_key_slots, false);
PyType_Spec interner_spec = Spec<ContextInterner>(
    "jaxworks.jit_cache._signature.ContextInterner", interner_slots, true);

py::object MakeType(PyType_Spec* spec) {
  PyObject* type = PyType_FromSpec(spec);
  if (type == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(type);
}

}  // namespace

PYBIND11_MODULE(_signature, m) {
  m.doc() =
      "Hashable argument signatures for jaxworks.jit_cache (see signature.h).";
  py::object signature = MakeType(&signature_spec);
  py::object context_key = MakeType(&context_key_spec);
  // The module keeps both types alive for as long as the process runs.
  g_signature_type = reinterpret_cast<PyTypeObject*>(signature.ptr());
  g_context_key_type = reinterpret_cast<PyTypeObject*>(context_key.ptr());
  m.attr("Signature") = signature;
  m.attr("ContextKey") = context_key;
  m.attr("SignatureBuilder") = MakeType(&builder_spec);
  m.attr("ContextInterner") = MakeType(&interner_spec);
  py::object forwarder = MakeType(&forwarder_spec);
  g_forwarder_type = reinterpret_cast<PyTypeObject*>(forwarder.ptr());
  m.attr("Forwarder") = forwarder;
  if (PyModule_AddFunctions(m.ptr(), module_functions) != 0) {
    throw py::error_already_set();
  }
}
