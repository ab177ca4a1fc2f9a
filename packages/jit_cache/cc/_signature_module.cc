// Python bindings for signature.h: module jaxworks.jit_cache._signature.
// signature.h first: it configures pybind11 before pybind11 is included.
#include "signature.h"

#include <pybind11/pybind11.h>

#include <memory>

namespace py = pybind11;
using jaxworks::jit_cache::ContextInterner;
using jaxworks::jit_cache::ContextKey;
using jaxworks::jit_cache::LeafKindName;
using jaxworks::jit_cache::Signature;
using jaxworks::jit_cache::SignatureBuilder;

namespace {

Py_hash_t ToPyHash(size_t h) {
  Py_hash_t out = static_cast<Py_hash_t>(h);
  return out == -1 ? -2 : out;  // -1 is reserved for errors
}

// __hash__ and ==/!= as C slots rather than pybind11 methods: dictionary
// look-ups then call straight into C++ (about 10x cheaper per look-up).
template <typename T>
Py_hash_t HashSlot(PyObject* self) {
  if (!py::detail::is_holder_constructed(self)) {
    PyErr_SetString(PyExc_TypeError, "uninitialised jit_cache key object");
    return -1;
  }
  return ToPyHash(py::cast<const T&>(py::handle(self)).hash());
}

template <typename T>
PyObject* RichCompareSlot(PyObject* self, PyObject* other, int op) {
  if ((op != Py_EQ && op != Py_NE) || Py_TYPE(other) != Py_TYPE(self) ||
      !py::detail::is_holder_constructed(self) ||
      !py::detail::is_holder_constructed(other)) {
    Py_RETURN_NOTIMPLEMENTED;
  }
  try {
    bool equal = py::cast<const T&>(py::handle(self))
                     .Equals(py::cast<const T&>(py::handle(other)));
    return PyBool_FromLong((op == Py_EQ) == equal);
  } catch (py::error_already_set& e) {  // a user-defined __eq__ raised
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

}  // namespace

PYBIND11_MODULE(_signature, m) {
  m.doc() =
      "Hashable argument signatures for jaxworks.jit_cache (see signature.h).";

  py::class_<Signature>(
      m, "Signature", py::is_final(),
      "Signature of one call's flattened arguments; built by "
      "SignatureBuilder, hash precomputed.",
      py::custom_type_setup([](PyHeapTypeObject* heap_type) {
        // Participate in cyclic GC (static arguments can point back to the
        // cache that holds the signature).
        PyTypeObject* type = &heap_type->ht_type;
        type->tp_hash = HashSlot<Signature>;
        type->tp_richcompare = RichCompareSlot<Signature>;
        type->tp_flags |= Py_TPFLAGS_HAVE_GC;
        type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) {
          Py_VISIT(Py_TYPE(self));
          if (!py::detail::is_holder_constructed(self)) return 0;
          return py::cast<const Signature&>(py::handle(self))
              .Traverse(visit, arg);
        };
        type->tp_clear = [](PyObject* self) {
          if (py::detail::is_holder_constructed(self)) {
            py::cast<Signature&>(py::handle(self)).Clear();
          }
          return 0;
        };
      }))
      .def("__len__", &Signature::size)
      .def("__repr__", &Signature::Repr)
      .def_property_readonly("extra",
                             [](const Signature& s) -> py::object {
                               return s.extra() ? s.extra() : py::none();
                             })
      .def_property_readonly("has_tracer", &Signature::has_tracer)
      .def("describe", &Signature::Describe,
           "One (kind, first, second, committed) tuple per leaf.");

  py::class_<SignatureBuilder>(m, "SignatureBuilder", py::is_final())
      .def(py::init<py::tuple, py::object, py::object, py::object,
                    py::object>(),
           py::arg("array_types"), py::arg("tracer_type"),
           py::arg("ndarray_type"), py::arg("numpy_generic_type"),
           py::arg("fallback"))
      .def("__call__", &SignatureBuilder::Build, py::arg("leaves"),
           py::arg("extra") = py::none(),
           "Signature of a list/tuple of leaves plus one hashable extra.")
      .def(
          "classify",
          [](const SignatureBuilder& b, py::handle leaf) {
            return LeafKindName(b.Classify(leaf));
          },
          py::arg("leaf"), "The leaf kind name, without calling the fallback.");

  py::class_<ContextKey, std::shared_ptr<ContextKey>>(
      m, "ContextKey", py::is_final(),
      py::custom_type_setup([](PyHeapTypeObject* heap_type) {
        heap_type->ht_type.tp_hash = HashSlot<ContextKey>;
        heap_type->ht_type.tp_richcompare = RichCompareSlot<ContextKey>;
      }))
      .def_property_readonly("values", &ContextKey::values)
      .def("__repr__", [](const ContextKey& k) {
        return "ContextKey(" + std::to_string(PyTuple_GET_SIZE(k.values().ptr())) +
               " values)";
      });

  py::class_<ContextInterner>(m, "ContextInterner", py::is_final())
      .def(py::init<size_t>(), py::arg("capacity") = 8)
      .def("__call__", &ContextInterner::Intern, py::arg("values"))
      .def("__len__", &ContextInterner::size);
}
