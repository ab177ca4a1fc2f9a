// Python bindings of the grouping logic: module
// jaxworks.batched_transfer._grouping.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "grouping.h"  // first: it sets pybind11 options

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
        py::arg("memory_kind_attr") = "memory_kind",
        "Groups leaf indices by (source devices, destination devices, source "
        "memory kind, destination memory kind, leaf kind), in stable order, "
        "with byte counts. See cc/grouping.h.");
}
