#include "grouping.h"

#include <cstddef>
#include <functional>  // std::hash
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace jaxworks::batched_transfer {
namespace {

constexpr const char* kApi = "jaxworks.batched_transfer._grouping.group_leaves";
constexpr size_t kIdentityEntries = 1024;

// repr() that never throws; long reprs are cut.
std::string SafeRepr(py::handle obj) {
  std::string out;
  try {
    out = py::repr(obj).cast<std::string>();
  } catch (py::error_already_set&) {
    out = std::string("<") + Py_TYPE(obj.ptr())->tp_name + " object>";
  } catch (py::cast_error&) {
    out = std::string("<") + Py_TYPE(obj.ptr())->tp_name + " object>";
  }
  if (out.size() > 120) out = out.substr(0, 117) + "...";
  return out;
}

// Raises TypeError(message) chained to the Python error in `err`.
[[noreturn]] void RaiseTypeErrorFrom(py::error_already_set& err, const std::string& message) {
  py::raise_from(err, PyExc_TypeError, message.c_str());
  throw py::error_already_set();
}

[[noreturn]] void RaiseTypeError(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw py::error_already_set();
}

[[noreturn]] void RaiseValueError(const std::string& message) {
  PyErr_SetString(PyExc_ValueError, message.c_str());
  throw py::error_already_set();
}

std::string LeafText(Py_ssize_t i, py::handle leaf) {
  return std::string(kApi) + ": leaf " + std::to_string(i) + " (" + SafeRepr(leaf) + ")";
}

py::tuple AsTuple(py::handle seq, const char* what) {
  if (!PySequence_Check(seq.ptr())) {
    RaiseTypeError(std::string(kApi) + ": " + what + " must be a sequence (list or tuple), got " +
                   Py_TYPE(seq.ptr())->tp_name);
  }
  PyObject* t = PySequence_Tuple(seq.ptr());
  if (t == nullptr) {
    py::error_already_set err;
    RaiseTypeErrorFrom(err, std::string(kApi) + ": could not read " + what + " as a sequence");
  }
  return py::reinterpret_steal<py::tuple>(t);
}

// getattr(obj, name) as a new reference; throws error_already_set on failure.
py::object GetAttr(py::handle obj, const py::str& name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// An int >= 0 from any object with __index__; `what()` names it in errors.
template <typename What>
int64_t ReadCount(py::handle obj, const What& what) {
  if (PyLong_CheckExact(obj.ptr())) {  // the common case, without a new reference
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj.ptr(), &overflow);
    if (overflow == 0 && v >= 0) return static_cast<int64_t>(v);
  }
  PyObject* idx = PyNumber_Index(obj.ptr());
  if (idx == nullptr) {
    py::error_already_set err;
    RaiseTypeErrorFrom(err, what() + " is not an int: " + SafeRepr(obj));
  }
  py::object owned = py::reinterpret_steal<py::object>(idx);
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || v < 0) {
    RaiseValueError(what() + " is " + SafeRepr(obj) + ", expected an int in [0, 2**63)");
  }
  return static_cast<int64_t>(v);
}

template <typename What>
int64_t CheckedMul(int64_t a, int64_t b, const What& what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) RaiseValueError(what() + " overflows int64");
  return out;
}

// Attribute names, made into Python strings once per call.
struct Names {
  py::str nbytes{"nbytes"};
  py::str memory_kind{"memory_kind"};  // fallback when memory_kind_attr is missing
  py::str shape{"shape"};
  py::str dtype{"dtype"};
  py::str itemsize{"itemsize"};
  py::str devices;
  py::str memory_kind_attr;
};

enum class SizeRule { kFixed, kNbytes, kShapeDtype };

struct KindInfo {
  int code = kOtherKind;
  bool on_device = false;     // whether the leaf has a source sharding
  py::object sharding_attr;  // the attribute holding it (on-device kinds only)
  SizeRule rule = SizeRule::kFixed;
  int64_t fixed = 0;
  py::object size_attr;  // for kShapeDtype: attribute holding shape/dtype, None = the leaf
};

// Parses the kinds dict into a map keyed by exact type. The type objects are
// kept alive in `keep_alive` so their pointers stay valid for the call.
std::unordered_map<PyTypeObject*, KindInfo> ParseKinds(py::handle kinds,
                                                       std::vector<py::object>* keep_alive) {
  if (!PyDict_Check(kinds.ptr())) {
    RaiseTypeError(std::string(kApi) +
                   ": kinds must be a dict {type: (code, sharding_attr, size)}, got " +
                   Py_TYPE(kinds.ptr())->tp_name);
  }
  // A snapshot of the items: reading the values below may run Python code.
  py::list items = py::reinterpret_steal<py::list>(PyDict_Items(kinds.ptr()));
  if (!items) throw py::error_already_set();
  std::unordered_map<PyTypeObject*, KindInfo> out;
  for (py::handle item : items) {
    py::handle key = PyTuple_GET_ITEM(item.ptr(), 0);
    py::handle value = PyTuple_GET_ITEM(item.ptr(), 1);
    if (!PyType_Check(key.ptr())) {
      RaiseTypeError(std::string(kApi) + ": kinds keys must be types, got " + SafeRepr(key));
    }
    auto bad = [&]() {
      RaiseTypeError(std::string(kApi) + ": kinds[" + SafeRepr(key) +
                     "] must be a tuple (code: int >= -1, sharding_attr: str or None, size: "
                     "int >= -1 or str), got " + SafeRepr(value));
    };
    if (!PyTuple_Check(value.ptr()) || PyTuple_GET_SIZE(value.ptr()) != 3) bad();
    PyObject* code = PyTuple_GET_ITEM(value.ptr(), 0);
    PyObject* sharding_attr = PyTuple_GET_ITEM(value.ptr(), 1);
    PyObject* size = PyTuple_GET_ITEM(value.ptr(), 2);
    if (!PyLong_Check(code) || PyBool_Check(code)) bad();
    if (sharding_attr != Py_None && !PyUnicode_Check(sharding_attr)) bad();
    KindInfo info;
    int overflow = 0;
    long c = PyLong_AsLongAndOverflow(code, &overflow);
    if (overflow != 0 || c < -1 || c > (1 << 30)) bad();
    info.code = static_cast<int>(c);
    info.on_device = sharding_attr != Py_None;
    info.sharding_attr = py::reinterpret_borrow<py::object>(sharding_attr);
    if (PyUnicode_Check(size)) {
      info.rule = SizeRule::kShapeDtype;
      info.size_attr = PyUnicode_GET_LENGTH(size) == 0
                           ? py::object(py::none())
                           : py::reinterpret_borrow<py::object>(size);
    } else if (PyLong_Check(size) && !PyBool_Check(size)) {
      long long f = PyLong_AsLongLongAndOverflow(size, &overflow);
      if (overflow != 0 || f < -1) bad();
      info.rule = f == -1 ? SizeRule::kNbytes : SizeRule::kFixed;
      info.fixed = f == -1 ? 0 : f;
    } else {
      bad();
    }
    keep_alive->push_back(py::reinterpret_borrow<py::object>(key));
    out[reinterpret_cast<PyTypeObject*>(key.ptr())] = std::move(info);
  }
  return out;
}

// The device list and memory kind of one sharding object.
struct Placement {
  py::object sharding;  // keeps the sharding (and so the pointer key) alive for the call
  py::object devices;
  py::object memory_kind;
};

// Reads each distinct sharding object once per call.
class PlacementCache {
 public:
  explicit PlacementCache(const Names& names) : names_(names) {}

  const Placement& Get(py::handle sharding, Py_ssize_t i, const char* role) {
    auto it = map_.find(sharding.ptr());
    if (it != map_.end()) return it->second;
    Placement p;
    try {
      p.devices = GetAttr(sharding, names_.devices);
      PyObject* mk = PyObject_GetAttr(sharding.ptr(), names_.memory_kind_attr.ptr());
      if (mk == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();  // not a jax sharding class: use the public property
        mk = PyObject_GetAttr(sharding.ptr(), names_.memory_kind.ptr());
      }
      if (mk == nullptr) throw py::error_already_set();
      p.memory_kind = py::reinterpret_steal<py::object>(mk);
    } catch (py::error_already_set& err) {
      RaiseTypeErrorFrom(err, std::string(kApi) + ": the " + role + " of leaf " +
                                  std::to_string(i) + " must be a jax.sharding.Sharding, got " +
                                  SafeRepr(sharding));
    }
    p.sharding = py::reinterpret_borrow<py::object>(sharding);
    return map_.emplace(sharding.ptr(), std::move(p)).first->second;
  }

 private:
  const Names& names_;
  std::unordered_map<PyObject*, Placement> map_;  // node based: references stay valid
};

// The grouping key by identity: kind and the four component pointers. The
// pointed-to objects are owned by the PlacementCache or are None.
struct PtrKey {
  int kind;
  PyObject* parts[4];
  bool operator==(const PtrKey& o) const {
    return kind == o.kind && parts[0] == o.parts[0] && parts[1] == o.parts[1] &&
           parts[2] == o.parts[2] && parts[3] == o.parts[3];
  }
};

struct PtrKeyHash {
  size_t operator()(const PtrKey& k) const {
    size_t h = std::hash<int>()(k.kind);
    for (PyObject* p : k.parts) h = h * 1000003 ^ std::hash<const void*>()(p);
    return h;
  }
};

// The grouping key by value: Python hash and ==, for components that are equal
// but not identical (two shardings with equal device lists).
struct Key {
  int kind;
  py::object parts[4];
  Py_hash_t hash;
};

struct KeyHash {
  size_t operator()(const Key& k) const { return static_cast<size_t>(k.hash); }
};

// Identity first, then Python ==. A raising __eq__ propagates as
// error_already_set (std::unordered_map::find is exception neutral).
struct KeyEq {
  bool operator()(const Key& a, const Key& b) const {
    if (a.kind != b.kind || a.hash != b.hash) return false;
    for (int j = 0; j < 4; ++j) {
      if (a.parts[j].ptr() == b.parts[j].ptr()) continue;
      int eq = PyObject_RichCompareBool(a.parts[j].ptr(), b.parts[j].ptr(), Py_EQ);
      if (eq < 0) throw py::error_already_set();
      if (eq == 0) return false;
    }
    return true;
  }
};

Key MakeKey(int kind, PyObject* const parts[4]) {
  static const char* const kNames[4] = {"source devices", "destination devices",
                                        "source memory kind", "destination memory kind"};
  Key key{kind, {}, static_cast<Py_hash_t>(kind) * 1000003};
  for (int j = 0; j < 4; ++j) {
    key.parts[j] = py::reinterpret_borrow<py::object>(parts[j]);
    Py_hash_t p = PyObject_Hash(parts[j]);
    if (p == -1 && PyErr_Occurred()) {
      py::error_already_set err;
      RaiseTypeErrorFrom(err, std::string(kApi) + ": the " + kNames[j] + " " +
                                  SafeRepr(key.parts[j]) + " are not hashable");
    }
    key.hash = (key.hash ^ p) * 1000003;
  }
  if (key.hash == -1) key.hash = -2;
  return key;
}

// Bytes of a leaf whose size rule is kShapeDtype: prod(shape) * dtype.itemsize.
class SizeReader {
 public:
  explicit SizeReader(const Names& names) : names_(names) {}

  int64_t Read(py::handle leaf, const KindInfo& info, Py_ssize_t i) {
    auto what = [&]() { return LeafText(i, leaf) + " size"; };
    py::object holder;
    py::object shape, dtype;
    try {
      holder = info.size_attr.is_none() ? py::reinterpret_borrow<py::object>(leaf)
                                        : GetAttr(leaf, info.size_attr);
      shape = GetAttr(holder, names_.shape);
      dtype = GetAttr(holder, names_.dtype);
    } catch (py::error_already_set& err) {
      RaiseTypeErrorFrom(err, what() + ": could not read .shape and .dtype");
    }
    if (!PyTuple_Check(shape.ptr())) {
      RaiseTypeError(what() + ": .shape must be a tuple, got " + SafeRepr(shape));
    }
    int64_t count = 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape.ptr()); ++d) {
      count = CheckedMul(count, ReadCount(PyTuple_GET_ITEM(shape.ptr(), d), what), what);
    }
    int64_t itemsize;
    auto it = itemsize_.find(dtype.ptr());
    if (it != itemsize_.end()) {
      itemsize = it->second;
    } else {
      py::object v;
      try {
        v = GetAttr(dtype, names_.itemsize);
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, what() + ": .dtype has no .itemsize");
      }
      itemsize = ReadCount(v, [&]() { return what() + " itemsize"; });
      keep_.push_back(dtype);  // keeps the pointer key valid for the call
      itemsize_.emplace(dtype.ptr(), itemsize);
    }
    return CheckedMul(count, itemsize, what);
  }

 private:
  const Names& names_;
  std::unordered_map<PyObject*, int64_t> itemsize_;
  std::vector<py::object> keep_;
};

}  // namespace

std::string Group::Repr() const {
  return "Group(kind=" + std::to_string(kind) + ", src_devices=" + SafeRepr(src_devices) +
         ", dst_devices=" + SafeRepr(dst_devices) + ", src_memory_kind=" +
         SafeRepr(src_memory_kind) + ", dst_memory_kind=" + SafeRepr(dst_memory_kind) +
         ", indices=" + SafeRepr(indices) + ", nbytes=" + std::to_string(nbytes) + ")";
}

std::vector<Group> GroupLeaves(py::handle leaves, py::handle dsts, py::handle kinds,
                               py::handle default_dst, const std::string& devices_attr,
                               const std::string& memory_kind_attr) {
  // Snapshots: user code run below (__eq__, __hash__, properties) cannot
  // resize what we iterate over.
  py::tuple leaf_t = AsTuple(leaves, "leaves");
  py::tuple dst_t = AsTuple(dsts, "dsts");
  const Py_ssize_t n = PyTuple_GET_SIZE(leaf_t.ptr());
  if (PyTuple_GET_SIZE(dst_t.ptr()) != n) {
    RaiseValueError(std::string(kApi) + ": got " + std::to_string(n) + " leaves but " +
                    std::to_string(PyTuple_GET_SIZE(dst_t.ptr())) +
                    " dsts; pass one destination (or None) per leaf");
  }
  Names names;
  names.devices = py::str(devices_attr);
  names.memory_kind_attr = py::str(memory_kind_attr);
  std::vector<py::object> keep_alive;
  const auto kind_table = ParseKinds(kinds, &keep_alive);
  const KindInfo other;

  PlacementCache placements(names);
  SizeReader sizes(names);
  std::vector<Group> groups;
  std::vector<std::vector<Py_ssize_t>> members;
  std::unordered_map<PtrKey, size_t, PtrKeyHash> by_identity;
  std::unordered_map<Key, size_t, KeyHash, KeyEq> by_value;

  PyTypeObject* last_type = nullptr;
  const KindInfo* info = &other;
  PyObject* last_src = nullptr;  // last source sharding and its placement
  const Placement* last_src_p = nullptr;
  PyObject* last_dst = nullptr;  // last destination sharding and its placement
  const Placement* last_dst_p = nullptr;
  bool have_last = false;
  PtrKey last_key{};
  size_t last_group = 0;

  for (Py_ssize_t i = 0; i < n; ++i) {
    py::handle leaf = PyTuple_GET_ITEM(leaf_t.ptr(), i);
    py::handle dst = PyTuple_GET_ITEM(dst_t.ptr(), i);

    PyTypeObject* type = Py_TYPE(leaf.ptr());
    if (type != last_type) {
      auto it = kind_table.find(type);
      info = it == kind_table.end() ? &other : &it->second;
      last_type = type;
    }

    const bool on_device = info->on_device;
    PtrKey key{info->code, {Py_None, Py_None, Py_None, Py_None}};
    if (on_device) {
      py::object sharding;
      try {
        sharding = GetAttr(leaf, py::reinterpret_borrow<py::str>(info->sharding_attr));
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, LeafText(i, leaf) + " is registered as an on-device kind but "
                                    "its ." + info->sharding_attr.cast<std::string>() +
                                    " cannot be read");
      }
      if (sharding.ptr() != last_src) {
        last_src_p = &placements.Get(sharding, i, "source sharding");
        last_src = sharding.ptr();  // kept alive by the cache entry
      }
      key.parts[0] = last_src_p->devices.ptr();
      key.parts[2] = last_src_p->memory_kind.ptr();
    }

    py::handle target = dst;
    if (dst.is_none()) {
      if (on_device) {
        key.parts[1] = key.parts[0];
        key.parts[3] = key.parts[2];
        target = py::handle();
      } else if (default_dst.is_none()) {
        RaiseTypeError(LeafText(i, leaf) +
                       " is a host value with destination None and no default_dst was given");
      } else {
        target = default_dst;
      }
    }
    if (target) {
      if (target.ptr() != last_dst) {
        last_dst_p = &placements.Get(target, i, dst.is_none() ? "default destination"
                                                              : "destination");
        last_dst = target.ptr();
      }
      key.parts[1] = last_dst_p->devices.ptr();
      key.parts[3] = last_dst_p->memory_kind.ptr();
    }

    int64_t nbytes = info->fixed;
    if (info->rule == SizeRule::kNbytes) {
      py::object nb;
      try {
        nb = GetAttr(leaf, names.nbytes);
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, LeafText(i, leaf) + " has no readable .nbytes");
      }
      nbytes = ReadCount(nb, [&]() { return LeafText(i, leaf) + " .nbytes"; });
    } else if (info->rule == SizeRule::kShapeDtype) {
      nbytes = sizes.Read(leaf, *info, i);
    }

    size_t gid;
    if (have_last && key == last_key) {
      gid = last_group;
    } else {
      auto it = by_identity.find(key);
      if (it != by_identity.end()) {
        gid = it->second;
      } else {
        Key value_key = MakeKey(key.kind, key.parts);
        decltype(by_value)::iterator found;
        try {
          found = by_value.find(value_key);
        } catch (py::error_already_set& err) {
          RaiseTypeErrorFrom(err, std::string(kApi) +
                                      ": comparing the devices or memory kinds of leaf " +
                                      std::to_string(i) + " raised");
        }
        if (found != by_value.end()) {
          gid = found->second;
        } else {
          gid = groups.size();
          Group g;
          g.kind = key.kind;
          g.src_devices = value_key.parts[0];
          g.dst_devices = value_key.parts[1];
          g.src_memory_kind = value_key.parts[2];
          g.dst_memory_kind = value_key.parts[3];
          groups.push_back(std::move(g));
          members.emplace_back();
          by_value.emplace(std::move(value_key), gid);
        }
        // Leaves that each bring their own device-list object (every
        // single-device jax.Array does) would only grow this map, so it stops
        // growing after a while; lookups by value still find their group.
        if (by_identity.size() < kIdentityEntries) by_identity.emplace(key, gid);
      }
      have_last = true;
      last_key = key;
      last_group = gid;
    }
    members[gid].push_back(i);
    int64_t total = 0;
    if (__builtin_add_overflow(groups[gid].nbytes, nbytes, &total)) {
      RaiseValueError(std::string(kApi) + ": the byte count of a group overflows int64");
    }
    groups[gid].nbytes = total;
  }

  for (size_t g = 0; g < groups.size(); ++g) {
    py::list idx(members[g].size());
    for (size_t k = 0; k < members[g].size(); ++k) {
      PyObject* v = PyLong_FromSsize_t(members[g][k]);
      if (v == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(idx.ptr(), static_cast<Py_ssize_t>(k), v);
    }
    groups[g].indices = std::move(idx);
  }
  return groups;
}

}  // namespace jaxworks::batched_transfer
