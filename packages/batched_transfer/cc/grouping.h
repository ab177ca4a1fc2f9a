// Grouping of pytree leaves for batched transfers.
//
// A transfer of N leaves is cheapest as one backend call per set of leaves
// that share source devices, destination devices, memory kinds and the kind of
// leaf (host array, device array, ...). GroupLeaves computes those sets in one
// pass over the leaves, in stable order (groups by first appearance, indices
// ascending), with the byte count of each group.
//
// The pass is fast because nearly every lookup is by pointer: the device list
// and memory kind of each distinct sharding object are read once and replaced
// by the first equal (==) object seen in the call, so a group key is the kind
// and four pointers (equal device lists held by different objects still share
// a group); byte counts are computed once per distinct shape holder (a
// jax.Array's abstract value); attributes that are properties (jax.Array's
// ._sharding and .aval) are read by calling the property's getter directly.
//
// Every entry point accepts arbitrary Python objects: bad input raises a Python
// TypeError or ValueError (never a crash). The GIL must be held by the caller.
#ifndef JAXWORKS_BATCHED_TRANSFER_CC_GROUPING_H_
#define JAXWORKS_BATCHED_TRANSFER_CC_GROUPING_H_

// The GIL is held throughout (see above), so pybind11's per-incref GIL
// assertion (on in builds without NDEBUG) only costs time in the hot loop.
#ifndef PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#define PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#endif

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace jaxworks::batched_transfer {

// Kind code given to leaves whose exact type is not in the kinds table.
inline constexpr int kOtherKind = -1;

// One group of leaves that can move in one batched call.
struct Group {
  int kind = kOtherKind;
  pybind11::object src_devices;  // None for host leaves
  pybind11::object dst_devices;
  pybind11::object src_memory_kind;  // None for host leaves
  pybind11::object dst_memory_kind;
  pybind11::list indices;  // leaf indices, ascending
  int64_t nbytes = 0;

  std::string Repr() const;
};

// Groups `leaves` (a sequence) by
//   (source devices, destination devices, source memory kind,
//    destination memory kind, kind of leaf).
//
// Args:
//   leaves: sequence of arbitrary objects.
//   dsts: sequence of the same length; each item is a destination sharding
//     (any object with attributes `devices_attr` and `memory_kind_attr`, or
//     `memory_kind`) or None. None means "where the leaf already is" for
//     on-device leaves and `default_dst` for the others.
//   kinds: dict mapping an exact type to a tuple (code, sharding_attr, size):
//     code: int >= -1, the leaf kind reported in Group.kind;
//     sharding_attr: None for host kinds; for on-device kinds the attribute
//       of the leaf holding its source sharding;
//     size: how to count bytes: an int >= 0 (that many bytes), -1 (read
//       `leaf.nbytes`), or a str attr (prod(x.shape) * x.dtype.itemsize of
//       x = getattr(leaf, attr), or of the leaf itself when attr is "").
//     Types not in the dict get kOtherKind, no source and 0 bytes.
//   default_dst: destination sharding used for host leaves whose dst is None.
//   devices_attr: the attribute of a sharding holding its (hashable) device
//     list.
//   memory_kind_attr: the attribute of a sharding holding its memory kind
//     (the public `memory_kind` is read where it is missing).
//   device_keys: None, or a dict mapping an exact sharding type to the
//     attribute holding the one device its device list is made of (jax's
//     SingleDeviceSharding: its device): two such shardings whose attribute is
//     the same object have equal device lists, so only the first one's list is
//     read and compared (see PlacementCache in grouping.cc).
std::vector<Group> GroupLeaves(pybind11::handle leaves, pybind11::handle dsts,
                               pybind11::handle kinds,
                               pybind11::handle default_dst,
                               pybind11::str devices_attr,
                               pybind11::str memory_kind_attr,
                               pybind11::handle device_keys);

}  // namespace jaxworks::batched_transfer

#endif  // JAXWORKS_BATCHED_TRANSFER_CC_GROUPING_H_
