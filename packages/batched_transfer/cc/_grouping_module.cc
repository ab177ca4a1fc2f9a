// Python bindings of the grouping logic: module
// jaxworks.batched_transfer._grouping.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "grouping.h"  // first: it sets pybind11 options
#include "tools/cc/attr_reader.h"

namespace py = pybind11;
namespace bt = jaxworks::batched_transfer;

PYBIND11_MODULE(_grouping, m) {
  m.doc() = "C++ grouping of pytree leaves for jaxworks.batched_transfer.";
  m.attr("OTHER_KIND") = bt::kOtherKind;
  py::class_<bt::Group>(m, "Group", "Leaves that move in one batched call.")
      .def_readonly("kind", &bt::Group::kind)
      .def_readonly("src_devices", &bt::Group::src_devices)
      .def_readonly("dst_devices", &bt::Group::dst_devices)
      .def_readonly("src_memory_kind", &bt::Group::src_memory_kind)
      .def_readonly("dst_memory_kind", &bt::Group::dst_memory_kind)
      .def_readonly("indices", &bt::Group::indices)
      .def_readonly("nbytes", &bt::Group::nbytes)
      .def("__repr__", &bt::Group::Repr);
  m.def("group_leaves", &bt::GroupLeaves, py::arg("leaves"), py::arg("dsts"),
        py::arg("kinds"), py::arg("default_dst"), py::arg("devices_attr"),
        py::arg("memory_kind_attr") = py::str("memory_kind"),
        py::arg("device_keys") = py::none(),
        "Groups leaf indices by (source devices, destination devices, source "
        "memory kind, destination memory kind, leaf kind), in stable order, "
        "with byte counts. See cc/grouping.h.");
  // For tests: reads `name` of each object (all of exactly `type`) with one
  // FieldReader, checking each read against getattr, and returns whether the
  // reader then loads the attribute's word (tools/cc/attr_reader.h).
  m.def(
      "_field_read_learnt",
      [](py::type type, py::str name, py::list objects) {
        ::jaxworks::cc::FieldReader reader(
            reinterpret_cast<PyTypeObject*>(type.ptr()), name);
        for (py::handle obj : objects) {
          if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(type.ptr()))
            throw py::type_error("_field_read_learnt: objects of another type");
          py::object got = reader(obj);
          py::object want = py::getattr(obj, name);
          if (!got.is(want) && !got.equal(want))
            throw py::value_error(
                "_field_read_learnt: a read disagreed with getattr");
        }
        return reader.Direct();
      },
      py::arg("type"), py::arg("name"), py::arg("objects"));
}
