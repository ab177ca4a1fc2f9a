#include "grouping.h"

#include <pybind11/numpy.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "tools/cc/attr_reader.h"

namespace py = pybind11;

namespace jaxworks::batched_transfer {
namespace {

constexpr const char* kApi = "jaxworks.batched_transfer._grouping.group_leaves";

// repr() that never throws; long reprs are cut (at a UTF-8 character boundary).
std::string SafeRepr(py::handle obj) {
  std::string out;
  try {
    out = py::repr(obj).cast<std::string>();
  } catch (py::error_already_set&) {
    out = std::string("<") + Py_TYPE(obj.ptr())->tp_name + " object>";
  } catch (py::cast_error&) {
    out = std::string("<") + Py_TYPE(obj.ptr())->tp_name + " object>";
  }
  if (out.size() > 120) {
    size_t cut = 117;
    while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80)
      --cut;
    out = out.substr(0, cut) + "...";
  }
  return out;
}

// Raises TypeError(message) chained to the Python error in `err`.
[[noreturn]] void RaiseTypeErrorFrom(py::error_already_set& err,
                                     const std::string& message) {
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
  return std::string(kApi) + ": leaf " + std::to_string(i) + " (" +
         SafeRepr(leaf) + ")";
}

py::tuple AsTuple(py::handle seq, const char* what) {
  if (!PySequence_Check(seq.ptr())) {
    RaiseTypeError(std::string(kApi) + ": " + what +
                   " must be a sequence (list or tuple), got " +
                   Py_TYPE(seq.ptr())->tp_name);
  }
  PyObject* t = PySequence_Tuple(seq.ptr());
  if (t == nullptr) {
    py::error_already_set err;
    RaiseTypeErrorFrom(
        err, std::string(kApi) + ": could not read " + what + " as a sequence");
  }
  return py::reinterpret_steal<py::tuple>(t);
}

// getattr(obj, name) as a new reference; throws error_already_set on failure.
py::object GetAttr(py::handle obj, py::handle name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (v == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// An int >= 0 from any object with __index__; `what()` names it in errors.
template <typename What>
int64_t ReadCount(py::handle obj, const What& what) {
  if (PyLong_CheckExact(
          obj.ptr())) {  // the common case, without a new reference
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
    RaiseValueError(what() + " is " + SafeRepr(obj) +
                    ", expected an int in [0, 2**63)");
  }
  return static_cast<int64_t>(v);
}

template <typename What>
int64_t CheckedMul(int64_t a, int64_t b, const What& what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    RaiseValueError(what() + " overflows int64");
  return out;
}

// A Python string interned once per call: attribute lookups with it find the
// name in type and instance dicts by pointer.
py::str Interned(const std::string& text) {
  PyObject* s = PyUnicode_DecodeUTF8(
      text.data(), static_cast<Py_ssize_t>(text.size()), nullptr);
  if (s == nullptr) throw py::error_already_set();
  PyUnicode_InternInPlace(&s);
  return py::reinterpret_steal<py::str>(s);
}

// The same string interned (str subclasses are returned as they are).
py::object Interned(py::handle str) {
  PyObject* s = str.ptr();
  Py_INCREF(s);
  if (PyUnicode_CheckExact(s)) PyUnicode_InternInPlace(&s);
  return py::reinterpret_steal<py::object>(s);
}

// The attribute names the pass always reads, interned once per process (never
// freed: they must not be released after the interpreter is finalized).
struct FixedNames {
  py::str memory_kind = Interned("memory_kind");
  py::str shape = Interned("shape");
  py::str dtype = Interned("dtype");
  py::str itemsize = Interned("itemsize");
};

const FixedNames& Fixed() {
  static const FixedNames* const names = new FixedNames();
  return *names;
}

struct Names {
  // fallback when memory_kind_attr is missing
  py::str memory_kind = Fixed().memory_kind;
  py::str shape = Fixed().shape;
  py::str dtype = Fixed().dtype;
  py::str itemsize = Fixed().itemsize;
  py::object devices;
  py::object memory_kind_attr;
};

// A value computed once per distinct object, found by the object's pointer.
//
// In many trees every leaf brings new objects (each single-device jax.Array has
// its own sharding object), so a miss must cost little next to the attribute
// reads a hit saves: the cache is one flat open-addressing array (no
// allocation per entry) that stops growing at kMaxCached entries (measured:
// letting it grow to 100k entries costs more than it saves). Past
// kFilterFrom entries the table no longer stays in the CPU's L1 cache and a
// miss would cost a memory access: a 64 Kibit filter (one bit per hash,
// 8 KiB) answers most misses first. The cache holds a reference to each key,
// so its pointer cannot be reused by another object while the pass runs user
// code (properties, __eq__).
template <typename V>
class IdentityCache {
 public:
  static constexpr size_t kMaxCached = 4096;

  explicit IdentityCache(size_t max_entries = kMaxCached)
      : max_entries_(max_entries), slots_(size_t{1} << bits_) {}
  IdentityCache(const IdentityCache&) = delete;
  IdentityCache& operator=(const IdentityCache&) = delete;

  // The cached value, or nullptr.
  const V* Find(py::handle obj) const {
    const uint64_t h = Hash(obj.ptr());
    if (!filter_.empty() && !(filter_[FilterWord(h)] & FilterBit(h)))
      return nullptr;
    for (size_t i = Slot0(h);; i = Next(i)) {
      const Slot& s = slots_[i];
      if (s.key == obj.ptr()) return &s.value;
      if (s.key == nullptr) return nullptr;
    }
  }

  // Adds obj (not in the cache yet, unless the cache is full) and returns
  // value.
  V Insert(py::handle obj, V value) {
    if (keys_.size() == max_entries_) return value;
    if (2 * (keys_.size() + 1) > slots_.size()) Grow();
    keys_.push_back(py::reinterpret_borrow<py::object>(obj));
    Place(obj.ptr(), value);
    if (!filter_.empty()) {
      AddToFilter(obj.ptr());
    } else if (keys_.size() == kFilterFrom) {
      filter_.assign(kFilterWords, 0);
      for (const py::object& k : keys_) AddToFilter(k.ptr());
    }
    return value;
  }

 private:
  struct Slot {
    PyObject* key = nullptr;
    V value{};
  };

  static constexpr size_t kFilterFrom = 256;
  static constexpr size_t kFilterWords = 1024;  // 64 Kibit

  static uint64_t Hash(PyObject* key) {  // Fibonacci hashing of the address
    return reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull;
  }
  // The filter takes bits the slot index (the top bits_) does not use alone.
  static size_t FilterWord(uint64_t h) {
    return (h >> 38) & (kFilterWords - 1);
  }
  static uint64_t FilterBit(uint64_t h) {
    return uint64_t{1} << ((h >> 32) & 63);
  }
  size_t Slot0(uint64_t h) const {
    return static_cast<size_t>(h >> (64 - bits_));
  }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }

  void AddToFilter(PyObject* key) {
    const uint64_t h = Hash(key);
    filter_[FilterWord(h)] |= FilterBit(h);
  }

  void Place(PyObject* key, const V& value) {
    size_t i = Slot0(Hash(key));
    while (slots_[i].key != nullptr) i = Next(i);
    slots_[i] = Slot{key, value};
  }

  void Grow() {
    std::vector<Slot> old(size_t{1} << ++bits_);
    old.swap(slots_);
    for (const Slot& s : old) {
      if (s.key != nullptr) Place(s.key, s.value);
    }
  }

  size_t max_entries_;
  int bits_ = 4;
  std::vector<Slot> slots_;       // load factor <= 1/2
  std::vector<py::object> keys_;  // the references, in insertion order
  std::vector<uint64_t> filter_;  // empty below kFilterFrom entries
};

// Attribute reads through the type's cached data descriptor (jax.Array's
// ._sharding and .aval are properties: their getters are called directly),
// re-checked against the type's version tag; the objects that native getters
// return straight from a field of the instance (jaxlib's Array and shardings)
// are loaded from that field once learnt (tools/cc/attr_reader.h).
using ::jaxworks::cc::AttrReader;
using ::jaxworks::cc::FieldReader;

enum class SizeRule { kFixed, kNbytes, kShapeDtype };

struct KindInfo {
  int code = kOtherKind;
  bool on_device = false;  // whether the leaf has a source sharding
  FieldReader sharding;    // reads it (on-device kinds only)
  SizeRule rule = SizeRule::kFixed;
  int64_t fixed = 0;
  bool size_of_leaf =
      true;  // for kShapeDtype: shape/dtype of the leaf, or of an attribute:
  FieldReader size_holder;
  AttrReader nbytes;  // for kNbytes
  // For kNbytes on numpy arrays whose .nbytes is numpy's own: the byte count
  // read from the array's dimensions and descriptor (what .nbytes computes,
  // without a new int object per leaf), while the type's tag stays this.
  unsigned int numpy_tag = 0;
  bool numpy2 = false;  // numpy 2.x's dtype struct (for numpy_tag)
  // The readers above are made when a leaf of the type is first met (the
  // table has some 30 types, a tree often one or two).
  bool built = false;
  PyTypeObject* type = nullptr;
  PyObject* sharding_attr = nullptr;  // str, or None (held by the table)
  PyObject* size = nullptr;           // str, or int (held by the table)
};

// numpy's ndarray.nbytes of an ndarray, from its fields; `numpy2`: whether
// the numpy loaded is 2.x, whose dtype struct differs (pybind11's proxies).
int64_t NumpyNbytes(PyObject* leaf, bool numpy2) {
  const auto* a = py::detail::array_proxy(leaf);
  int64_t count = 1;
  for (int d = 0; d < a->nd; ++d) count *= a->dimensions[d];
  const int64_t itemsize =
      numpy2 ? py::detail::array_descriptor2_proxy(a->descr)->elsize
             : py::detail::array_descriptor1_proxy(a->descr)->elsize;
  return count * itemsize;
}

// Whether the numpy loaded is 2.x (looked up once: pybind11's numpy API
// table is reached through a per-interpreter store).
bool Numpy2() {
  return py::detail::npy_api::get().PyArray_RUNTIME_VERSION_ >= 0x12;
}

// The version tag of `type` when it is numpy's ndarray or a subclass that
// keeps ndarray's .nbytes, else 0.
unsigned int NumpyTag(PyTypeObject* type) {
  auto* ndarray = py::detail::npy_api::get().PyArray_Type_;
  if (!PyType_IsSubtype(type, ndarray)) return 0;
  static PyObject* const nbytes = PyUnicode_InternFromString("nbytes");
  if (nbytes == nullptr) throw py::error_already_set();
  if (_PyType_Lookup(type, nbytes) != _PyType_Lookup(ndarray, nbytes)) return 0;
  return type->tp_version_tag;
}

// The kinds dict, parsed: what to do with a leaf of each exact type.
class KindTable {
 public:
  explicit KindTable(py::handle kinds);

  const KindInfo& Get(PyTypeObject* type) {
    const size_t* k = index_.Find(reinterpret_cast<PyObject*>(type));
    if (k == nullptr) return other_;
    KindInfo& info = infos_[*k];
    if (!info.built) Build(info);
    return info;
  }

 private:
  static void Build(KindInfo& info);

  std::vector<py::object> held_;  // the values, checked (they hold the keys)
  std::vector<KindInfo> infos_;   // never resized after the constructor
  IdentityCache<size_t> index_{SIZE_MAX};  // type -> position in infos_
  const KindInfo other_;
};

KindTable::KindTable(py::handle kinds) {
  if (!PyDict_Check(kinds.ptr())) {
    RaiseTypeError(
        std::string(kApi) +
        ": kinds must be a dict {type: (code, sharding_attr, size)}, got " +
        Py_TYPE(kinds.ptr())->tp_name);
  }
  // No Python code runs while the items are checked (only exact type checks
  // and reads of ints), so the dict is walked in place; the values are held,
  // since code run later in the pass could change the dict.
  const auto size = static_cast<size_t>(PyDict_GET_SIZE(kinds.ptr()));
  infos_.reserve(size);
  held_.reserve(size);
  Py_ssize_t pos = 0;
  PyObject* key_ptr = nullptr;
  PyObject* value_ptr = nullptr;
  while (PyDict_Next(kinds.ptr(), &pos, &key_ptr, &value_ptr)) {
    py::handle key = key_ptr;
    py::handle value = value_ptr;
    if (!PyType_Check(key.ptr())) {
      RaiseTypeError(std::string(kApi) + ": kinds keys must be types, got " +
                     SafeRepr(key));
    }
    auto bad = [&]() {
      // Held: the reprs run Python code, which could change the dict.
      const py::object k = py::reinterpret_borrow<py::object>(key);
      const py::object v = py::reinterpret_borrow<py::object>(value);
      RaiseTypeError(std::string(kApi) + ": kinds[" + SafeRepr(k) +
                     "] must be a tuple (code: int >= -1, sharding_attr: str "
                     "or None, size: "
                     "int >= -1 or str), got " +
                     SafeRepr(v));
    };
    if (!PyTuple_Check(value.ptr()) || PyTuple_GET_SIZE(value.ptr()) != 3)
      bad();
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
    info.type = reinterpret_cast<PyTypeObject*>(key.ptr());
    info.sharding_attr = sharding_attr;
    info.size = size;
    if (PyUnicode_Check(size)) {
      info.rule = SizeRule::kShapeDtype;
      info.size_of_leaf = PyUnicode_GET_LENGTH(size) == 0;
    } else if (PyLong_Check(size) && !PyBool_Check(size)) {
      long long f = PyLong_AsLongLongAndOverflow(size, &overflow);
      if (overflow != 0 || f < -1) bad();
      info.rule = f == -1 ? SizeRule::kNbytes : SizeRule::kFixed;
      info.fixed = f == -1 ? 0 : f;
    } else {
      bad();
    }
    index_.Insert(key, infos_.size());  // dict keys are unique (held there)
    held_.push_back(py::reinterpret_borrow<py::object>(value));
    infos_.push_back(std::move(info));
  }
}

void KindTable::Build(KindInfo& info) {
  PyTypeObject* type = info.type;
  if (info.on_device)
    info.sharding = FieldReader(type, Interned(info.sharding_attr));
  if (info.rule == SizeRule::kShapeDtype && !info.size_of_leaf)
    info.size_holder = FieldReader(type, Interned(info.size));
  if (info.rule == SizeRule::kNbytes) {
    static PyObject* const nbytes = PyUnicode_InternFromString("nbytes");
    if (nbytes == nullptr) throw py::error_already_set();
    info.nbytes = AttrReader(type, py::reinterpret_borrow<py::object>(nbytes));
    info.numpy_tag = NumpyTag(type);
    if (info.numpy_tag != 0) info.numpy2 = Numpy2();
  }
  info.built = true;
}

// Maps each object to the first object seen that is == to it. Equal device
// lists (or memory kinds) held by distinct objects thereby become one pointer,
// so a group key can be compared by identity alone.
class Canonicalizer {
 public:
  // A borrowed reference, owned by this object. `what()` names `obj` in errors.
  template <typename What>
  PyObject* Get(py::handle obj, const What& what) {
    // Exact strs (memory kinds: a new str per sharding, of 2 or 3 values in
    // all) are compared with the few seen so far by their characters, which
    // is what str == does, without hashing each new object.
    const bool exact_str = PyUnicode_CheckExact(obj.ptr());
    if (exact_str) {
      for (PyObject* s : strs_) {
        if (s == obj.ptr() || Same(s, obj.ptr())) return s;
      }
    }
    PyObject* canonical = PyDict_SetDefault(first_.ptr(), obj.ptr(), obj.ptr());
    if (canonical != nullptr) {
      if (exact_str && strs_.size() < kMaxStrs) strs_.push_back(canonical);
      return canonical;
    }
    py::error_already_set err;
    const bool hashable = PyObject_Hash(obj.ptr()) != -1 || !PyErr_Occurred();
    PyErr_Clear();
    RaiseTypeErrorFrom(err,
                       what() + (hashable ? " could not be compared with =="
                                          : " are not hashable"));
  }

 private:
  static constexpr size_t kMaxStrs = 8;

  // Whether two exact strs hold the same characters.
  static bool Same(PyObject* a, PyObject* b) {
    const Py_ssize_t len = PyUnicode_GET_LENGTH(a);
    return len == PyUnicode_GET_LENGTH(b) &&
           PyUnicode_KIND(a) == PyUnicode_KIND(b) &&
           std::memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b),
                       static_cast<size_t>(len) * PyUnicode_KIND(a)) == 0;
  }

  py::dict first_;               // obj -> the first object == to it
  std::vector<PyObject*> strs_;  // canonical exact strs (held by first_)
};

// The device list and memory kind of one sharding, as canonical pointers.
struct Placement {
  PyObject* devices;
  PyObject* memory_kind;
};

// Reads each distinct sharding object once per call.
//
// Trees of single-device jax.Arrays often hold as many sharding objects as
// leaves, each with its own device list object: making those one pointer
// (a hash and an == through Python's slots per sharding) would cost more
// than all the rest. For the sharding types in `device_keys` ({type: attr}),
// whose device list follows from the device object `attr` holds (a
// SingleDeviceSharding's device), the canonical device list is found by that
// object's identity instead, and read and compared only for a device not
// seen before in the call.
class PlacementCache {
 public:
  PlacementCache(const Names& names, py::handle device_keys)
      : names_(names), device_keys_(device_keys) {
    if (!device_keys.is_none() && !PyDict_Check(device_keys.ptr())) {
      RaiseTypeError(std::string(kApi) +
                     ": device_keys must be a dict {sharding type: attribute "
                     "name} or None, got " +
                     Py_TYPE(device_keys.ptr())->tp_name);
    }
  }

  Placement Get(py::handle sharding, Py_ssize_t i, const char* role) {
    if (const Placement* p = cache_.Find(sharding)) return *p;
    auto what = [&]() {
      return std::string(kApi) + ": the " + role + " of leaf " +
             std::to_string(i);
    };
    const Readers& read = ReadersFor(Py_TYPE(sharding.ptr()));
    py::object key, devices, memory_kind;
    PyObject* const* known = nullptr;
    try {
      if (read.keyed) {
        key = read.device_key(sharding);
        known = devices_by_key_.Find(key);
      }
      if (known == nullptr) devices = read.devices(sharding);
      try {
        memory_kind = read.memory_kind(sharding);
      } catch (py::error_already_set& err) {
        if (!err.matches(PyExc_AttributeError)) throw;
        // Not a jax.sharding class: the public property.
        memory_kind = GetAttr(sharding, names_.memory_kind);
      }
    } catch (py::error_already_set& err) {
      RaiseTypeErrorFrom(err, what() +
                                  " must be a jax.sharding.Sharding, got " +
                                  SafeRepr(sharding));
    }
    Placement p;
    if (known != nullptr) {
      p.devices = *known;
    } else {
      p.devices = devices_.Get(devices, [&]() {
        return what() + " (" + SafeRepr(sharding) + "): its devices " +
               SafeRepr(devices);
      });
      if (read.keyed) devices_by_key_.Insert(key, p.devices);
    }
    p.memory_kind = memory_kinds_.Get(memory_kind, [&]() {
      return what() + " (" + SafeRepr(sharding) + "): its memory kind " +
             SafeRepr(memory_kind);
    });
    return cache_.Insert(sharding, p);
  }

 private:
  struct Readers {
    FieldReader devices;
    FieldReader memory_kind;
    bool keyed = false;      // the type is in device_keys
    FieldReader device_key;  // reads its device (keyed types only)
  };

  const Readers& ReadersFor(PyTypeObject* type) {
    const auto key = reinterpret_cast<PyObject*>(type);
    const size_t* k = readers_of_.Find(key);
    if (k == nullptr) {
      Readers r{FieldReader(type, names_.devices),
                FieldReader(type, names_.memory_kind_attr)};
      if (!device_keys_.is_none()) {
        // A borrowed reference or null (never an error) for an exact type.
        PyObject* attr = PyDict_GetItemWithError(device_keys_.ptr(), key);
        if (attr == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (attr != nullptr) {
          if (!PyUnicode_Check(attr)) {
            RaiseTypeError(
                std::string(kApi) + ": device_keys[" + SafeRepr(key) +
                "] must be an attribute name (str), got " + SafeRepr(attr));
          }
          r.keyed = true;
          r.device_key = FieldReader(type, Interned(attr));
        }
      }
      readers_.push_back(std::move(r));
      readers_of_.Insert(key, readers_.size() - 1);
      return readers_.back();
    }
    return readers_[*k];
  }

  const Names& names_;
  py::handle device_keys_;  // held by the caller
  std::deque<Readers>
      readers_;  // per sharding type (a deque: references stay valid)
  IdentityCache<size_t> readers_of_{SIZE_MAX};
  Canonicalizer devices_;
  Canonicalizer memory_kinds_;
  IdentityCache<PyObject*> devices_by_key_;  // device -> canonical devices
  IdentityCache<Placement> cache_;
};

// The grouping key: kind and the four canonical component pointers (None for
// the source of host leaves). Equal keys <=> equal components.
struct GroupKey {
  int kind;
  PyObject* parts[4];
  bool operator==(const GroupKey& o) const {
    return kind == o.kind && parts[0] == o.parts[0] && parts[1] == o.parts[1] &&
           parts[2] == o.parts[2] && parts[3] == o.parts[3];
  }
};

// Group ids by key, open addressing over the (usually few) groups.
class GroupIndex {
 public:
  // The id of key's group (ids count from 0 in order of first appearance), and
  // whether this call added it.
  std::pair<size_t, bool> FindOrAdd(const GroupKey& key) {
    if (2 * (keys_.size() + 1) > slots_.size()) Grow();
    size_t i = Slot0(key);
    for (; slots_[i] != kEmpty; i = Next(i)) {
      if (keys_[slots_[i]] == key) return {slots_[i], false};
    }
    slots_[i] = keys_.size();
    keys_.push_back(key);
    return {slots_[i], true};
  }

 private:
  static constexpr size_t kEmpty = SIZE_MAX;

  size_t Slot0(const GroupKey& key) const {
    uint64_t h = static_cast<uint64_t>(key.kind);
    for (PyObject* p : key.parts)
      h = (h ^ reinterpret_cast<uintptr_t>(p)) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> (64 - bits_));
  }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }

  void Grow() {
    slots_.assign(size_t{1} << ++bits_, kEmpty);
    for (size_t id = 0; id < keys_.size(); ++id) {
      size_t i = Slot0(keys_[id]);
      while (slots_[i] != kEmpty) i = Next(i);
      slots_[i] = id;
    }
  }

  int bits_ = 3;
  std::vector<size_t> slots_ = std::vector<size_t>(size_t{1} << bits_, kEmpty);
  std::vector<GroupKey> keys_;  // by id
};

// Bytes of a leaf whose size rule is kShapeDtype: prod(shape) * dtype.itemsize,
// computed once per distinct holder object (jax.Arrays of one shape and dtype
// usually share their abstract value) and itemsize once per dtype object.
class SizeReader {
 public:
  explicit SizeReader(const Names& names) : names_(names) {}

  int64_t Read(py::handle leaf, const KindInfo& info, Py_ssize_t i) {
    auto what = [&]() { return LeafText(i, leaf) + " size"; };
    py::object holder;
    try {
      holder = info.size_of_leaf ? py::reinterpret_borrow<py::object>(leaf)
                                 : info.size_holder(leaf);
    } catch (py::error_already_set& err) {
      RaiseTypeErrorFrom(err, what() + ": could not read .shape and .dtype");
    }
    if (const int64_t* bytes = bytes_.Find(holder)) return *bytes;
    py::object shape, dtype;
    try {
      shape = GetAttr(holder, names_.shape);
      dtype = GetAttr(holder, names_.dtype);
    } catch (py::error_already_set& err) {
      RaiseTypeErrorFrom(err, what() + ": could not read .shape and .dtype");
    }
    if (!PyTuple_Check(shape.ptr())) {
      RaiseTypeError(what() + ": .shape must be a tuple, got " +
                     SafeRepr(shape));
    }
    int64_t count = 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape.ptr()); ++d) {
      count = CheckedMul(
          count, ReadCount(PyTuple_GET_ITEM(shape.ptr(), d), what), what);
    }
    int64_t itemsize;
    if (const int64_t* cached = itemsize_.Find(dtype)) {
      itemsize = *cached;
    } else {
      py::object v;
      try {
        v = GetAttr(dtype, names_.itemsize);
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, what() + ": .dtype has no .itemsize");
      }
      itemsize = itemsize_.Insert(
          dtype, ReadCount(v, [&]() { return what() + " itemsize"; }));
    }
    return bytes_.Insert(holder, CheckedMul(count, itemsize, what));
  }

 private:
  const Names& names_;
  IdentityCache<int64_t> bytes_;     // holder -> bytes
  IdentityCache<int64_t> itemsize_;  // dtype -> itemsize
};

}  // namespace

std::string Group::Repr() const {
  return "Group(kind=" + std::to_string(kind) +
         ", src_devices=" + SafeRepr(src_devices) +
         ", dst_devices=" + SafeRepr(dst_devices) +
         ", src_memory_kind=" + SafeRepr(src_memory_kind) +
         ", dst_memory_kind=" + SafeRepr(dst_memory_kind) +
         ", indices=" + SafeRepr(indices) +
         ", nbytes=" + std::to_string(nbytes) + ")";
}

std::vector<Group> GroupLeaves(py::handle leaves, py::handle dsts,
                               py::handle kinds, py::handle default_dst,
                               py::str devices_attr, py::str memory_kind_attr,
                               py::handle device_keys) {
  // Snapshots: user code run below (__eq__, __hash__, properties) cannot
  // resize what we iterate over.
  py::tuple leaf_t = AsTuple(leaves, "leaves");
  py::tuple dst_t = AsTuple(dsts, "dsts");
  const Py_ssize_t n = PyTuple_GET_SIZE(leaf_t.ptr());
  if (PyTuple_GET_SIZE(dst_t.ptr()) != n) {
    RaiseValueError(std::string(kApi) + ": got " + std::to_string(n) +
                    " leaves but " +
                    std::to_string(PyTuple_GET_SIZE(dst_t.ptr())) +
                    " dsts; pass one destination (or None) per leaf");
  }
  Names names;
  names.devices = Interned(devices_attr);
  names.memory_kind_attr = Interned(memory_kind_attr);
  KindTable kind_table(kinds);

  PlacementCache placements(names, device_keys);
  SizeReader sizes(names);
  std::vector<Group> groups;
  std::vector<Py_ssize_t> sizes_of;  // leaves per group
  std::vector<uint32_t> group_ids;   // per leaf
  group_ids.reserve(static_cast<size_t>(n));
  GroupIndex group_of;

  // Runs of leaves usually share type, shardings and group: check the last ones
  // first.
  PyTypeObject* last_type = nullptr;
  const KindInfo* info = nullptr;
  // The last shardings are held: a pointer compared after the object was freed
  // could match a new object (placements does not hold every sharding).
  py::object last_src;
  Placement last_src_placement{};
  py::handle last_dst;  // held by dst_t or the caller
  Placement last_dst_placement{};
  GroupKey last_key{};
  size_t last_group = 0;

  constexpr Py_ssize_t kAhead = 8;
  constexpr Py_ssize_t kMaxPrefetch = 256;  // bytes of a leaf fetched ahead
  for (Py_ssize_t i = 0; i < n; ++i) {
    py::handle leaf = PyTuple_GET_ITEM(leaf_t.ptr(), i);
    py::handle dst = PyTuple_GET_ITEM(dst_t.ptr(), i);
    // Leaves of large trees are spread over memory that is not in cache:
    // fetch the header of the leaf 2 * kAhead ahead, and the rest of the
    // leaf kAhead ahead (whose type the header fetched before names).
    if (i + 2 * kAhead < n)
      __builtin_prefetch(PyTuple_GET_ITEM(leaf_t.ptr(), i + 2 * kAhead));
    if (i + kAhead < n) {
      const char* ahead = reinterpret_cast<const char*>(
          PyTuple_GET_ITEM(leaf_t.ptr(), i + kAhead));
      const Py_ssize_t size = Py_TYPE(ahead)->tp_basicsize;
      for (Py_ssize_t off = 64; off < size && off < kMaxPrefetch; off += 64)
        __builtin_prefetch(ahead + off);
    }

    PyTypeObject* type = Py_TYPE(leaf.ptr());
    if (type != last_type) {
      info = &kind_table.Get(type);
      last_type = type;
    }

    const bool on_device = info->on_device;
    GroupKey key{info->code, {Py_None, Py_None, Py_None, Py_None}};
    if (on_device) {
      py::object sharding;
      try {
        sharding = info->sharding(leaf);
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, LeafText(i, leaf) +
                                    " is registered as an on-device kind but "
                                    "its ." +
                                    info->sharding.name().cast<std::string>() +
                                    " cannot be read");
      }
      if (sharding.ptr() != last_src.ptr()) {
        last_src_placement = placements.Get(sharding, i, "source sharding");
        last_src = std::move(sharding);
      }
      key.parts[0] = last_src_placement.devices;
      key.parts[2] = last_src_placement.memory_kind;
    }

    py::handle target = dst;
    if (dst.is_none()) {
      if (on_device) {
        key.parts[1] = key.parts[0];
        key.parts[3] = key.parts[2];
        target = py::handle();
      } else if (default_dst.is_none()) {
        RaiseTypeError(LeafText(i, leaf) +
                       " is a host value with destination None and no "
                       "default_dst was given");
      } else {
        target = default_dst;
      }
    }
    if (target) {
      if (target.ptr() != last_dst.ptr()) {
        last_dst_placement = placements.Get(
            target, i, dst.is_none() ? "default destination" : "destination");
        last_dst = target;
      }
      key.parts[1] = last_dst_placement.devices;
      key.parts[3] = last_dst_placement.memory_kind;
    }

    int64_t nbytes = info->fixed;
    if (info->numpy_tag != 0 && type->tp_version_tag == info->numpy_tag) {
      nbytes = NumpyNbytes(leaf.ptr(), info->numpy2);
    } else if (info->rule == SizeRule::kNbytes) {
      py::object nb;
      try {
        nb = info->nbytes(leaf);
      } catch (py::error_already_set& err) {
        RaiseTypeErrorFrom(err, LeafText(i, leaf) + " has no readable .nbytes");
      }
      nbytes = ReadCount(nb, [&]() { return LeafText(i, leaf) + " .nbytes"; });
    } else if (info->rule == SizeRule::kShapeDtype) {
      nbytes = sizes.Read(leaf, *info, i);
    }

    if (groups.empty() || !(key == last_key)) {
      auto [id, is_new] = group_of.FindOrAdd(key);
      if (is_new) {
        Group g;
        g.kind = key.kind;
        g.src_devices = py::reinterpret_borrow<py::object>(key.parts[0]);
        g.dst_devices = py::reinterpret_borrow<py::object>(key.parts[1]);
        g.src_memory_kind = py::reinterpret_borrow<py::object>(key.parts[2]);
        g.dst_memory_kind = py::reinterpret_borrow<py::object>(key.parts[3]);
        groups.push_back(std::move(g));
        sizes_of.push_back(0);
      }
      last_key = key;
      last_group = id;
    }
    Group& group = groups[last_group];
    group_ids.push_back(static_cast<uint32_t>(last_group));
    ++sizes_of[last_group];
    if (__builtin_add_overflow(group.nbytes, nbytes, &group.nbytes)) {
      RaiseValueError(std::string(kApi) +
                      ": the byte count of a group overflows int64");
    }
  }

  // Each group's indices, in one pass over the leaves' group ids.
  std::vector<PyObject*> lists(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].indices = py::list(sizes_of[g]);
    lists[g] = groups[g].indices.ptr();
    sizes_of[g] = 0;  // now the next position in the list
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const uint32_t g = group_ids[static_cast<size_t>(i)];
    PyObject* v = PyLong_FromSsize_t(i);
    if (v == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(lists[g], sizes_of[g]++, v);
  }
  return groups;
}

}  // namespace jaxworks::batched_transfer
