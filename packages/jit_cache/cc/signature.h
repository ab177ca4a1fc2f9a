// Argument signatures for jaxworks.jit_cache.
//
// A Signature summarises the flattened arguments of one call: for each leaf
// its kind and abstract properties (never its value), plus one "extra" Python
// object (tree structure, static arguments, tracing context). The hash is
// computed once, when the signature is built, so a dictionary look-up costs
// one integer compare before the element-wise equality check.
//
// Leaf kinds and what they record (`first`, `second`, `committed`):
//   jax Array      aval (interned ShapedArray: shape, dtype, weak_type, ...),
//                  sharding, committed
//   Tracer         aval: the abstract value, never a concrete value
//   numpy ndarray  dtype, shape tuple
//   numpy scalar   its scalar type (one type <-> one dtype)
//   bool/int/float/complex (exact types)   nothing: the kind says it all
//   other          the hashable key returned by the Python fallback; without
//                  a fallback, or when it raises, a TypeError
//
// Every function here expects the GIL to be held. Python objects are owned by
// py::object members, so a Signature keeps its avals/shardings/dtypes alive
// and never the leaves themselves (no tracer or array is retained).
#ifndef JAXWORKS_JIT_CACHE_CC_SIGNATURE_H_
#define JAXWORKS_JIT_CACHE_CC_SIGNATURE_H_

// Every entry point runs with the GIL held (CPython calls the extension's
// slots with it), so pybind11's per-incref GIL assertion (on in builds
// without NDEBUG, e.g. Bazel's fastbuild) only costs time: about half of the
// per-leaf cost when measured. This header must be included before any
// pybind11 header.
#ifndef PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#define PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF
#endif

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tools/cc/attr_reader.h"

namespace jaxworks::jit_cache {

namespace py = pybind11;

enum class LeafKind : uint8_t {
  kJaxArray = 0,
  kTracer = 1,
  kNdarray = 2,
  kNumpyScalar = 3,
  kPyBool = 4,
  kPyInt = 5,
  kPyFloat = 6,
  kPyComplex = 7,
  kOther = 8,
};

const char* LeafKindName(LeafKind kind);

// Full 64-bit mix (splitmix64 finaliser) of `value` folded into `seed`.
size_t CombineHash(size_t seed, size_t value);

struct LeafSignature {
  LeafKind kind = LeafKind::kOther;
  bool committed = false;
  py::object first;   // aval | dtype | scalar type | fallback key | null
  py::object second;  // sharding | shape tuple | null
  // Cheap, unmixed summary of the fields (equal leaves, equal values); the
  // Signature mixes all of them into its hash.
  size_t hash = 0;
};

// Immutable once built.
class Signature {
 public:
  // May throw py::error_already_set when hashing `extra` raises.
  Signature(std::vector<LeafSignature> leaves, py::object extra);
  // With the hash of `extra` given (equal extras, equal hashes).
  Signature(std::vector<LeafSignature> leaves, py::object extra,
            size_t extra_hash);

  size_t hash() const { return hash_; }
  size_t size() const { return leaves_.size(); }
  const std::vector<LeafSignature>& leaves() const { return leaves_; }
  const py::object& extra() const { return extra_; }
  bool has_tracer() const { return has_tracer_; }

  // May throw py::error_already_set when a user-defined __eq__ raises.
  bool Equals(const Signature& other) const;

  // One tuple per leaf: (kind_name, first, second, committed).
  py::list Describe() const;
  std::string Repr() const;

  // Garbage-collector support: the extra object (static arguments) may lead
  // back to whatever holds this signature.
  int Traverse(visitproc visit, void* arg) const;
  void Clear();

 private:
  std::vector<LeafSignature> leaves_;
  py::object extra_;
  size_t hash_;
  bool has_tracer_;
};

// Attribute reads through the type's cached data descriptor, re-checked
// against the type's version tag (tools/cc/attr_reader.h).
using ::jaxworks::cc::AttrReader;

// Builds Signatures. It is told the Python types it recognises, and gets an
// optional fallback callable for other leaves: fallback(leaf) returns a
// hashable key, or raises TypeError for leaves that are not valid arguments.
class SignatureBuilder {
 public:
  // array_types: exact types treated as jax Arrays (read .aval, ._sharding,
  // ._committed). tracer_type: base class of tracers (read .aval). ndarray_type
  // and numpy_generic_type: numpy's ndarray and generic (may be None).
  //
  // array_samples: None, or a callable returning a list of jax Arrays, some
  // committed and some not, called once, at the first jax Array leaf, to find
  // where the array objects keep their aval, sharding and committed flag (see
  // ArrayLayout).
  SignatureBuilder(py::tuple array_types, py::object tracer_type,
                   py::object ndarray_type, py::object numpy_generic_type,
                   py::object fallback, py::object array_samples = py::none(),
                   py::object flatten = py::none());

  // `leaves` must be a list or a tuple, anything else is a TypeError.
  Signature Build(py::handle leaves, py::object extra) const;

  // The trace-cache key of one call (see KeyResult). Its tree structure is
  // read in C++ when `tree` is made of tuples, lists, dicts with str keys and
  // None around leaves the builder knows (jax Arrays, tracers, numpy arrays
  // and scalars, Python scalars): the treedef of a structure seen before is
  // taken from a memo. Otherwise the `flatten` callable given to the builder
  // flattens the tree. Leaves and signature are the same either way.
  struct KeyResult {
    py::object leaves;    // list, in JAX's flattening order
    py::object treedef;   // what flatten(tree) returns with them
    Signature signature;  // of the leaves; extra = (treedef, statics, ctx)
  };
  KeyResult Key(py::handle tree, py::object statics, py::object ctx) const;

  // True when the fields of a jax Array type are read directly (see
  // ArrayLayout), for tests.
  bool ReadsArrayFields() const {
    for (const ArrayReaders& r : array_readers_) {
      if (r.layout.state == ArrayLayout::State::kDirect) return true;
    }
    return false;
  }

  // The kind `leaf` would get (no fallback call), for tests and tools.
  LeafKind Classify(py::handle leaf) const;

  int Traverse(visitproc visit, void* arg) const;
  void Clear();

 private:
  void BuildLeaf(py::handle leaf, size_t index, LeafSignature& out) const;
  void TracerLeaf(AttrReader& aval, PyObject* obj, LeafSignature& out) const;
  AttrReader& TracerAvalReader(PyTypeObject* type) const;

  // Where objects of one array type hold aval, sharding and committed.
  // jaxlib's array object stores the three in fields the property getters
  // return as they are (the getters cost ~20 ns each, most of a leaf's
  // cost). The offsets are found on sample arrays (the words holding the very
  // aval and sharding objects the getters return; the committed flag two
  // words after the sharding, where jaxlib 0.10 keeps it) and used only when
  // every sample, committed or not, agrees with its getters; otherwise, or
  // for an object whose fields are unset, the getters are used. A change to
  // the type (its version tag: a property replaced) has them learnt again.
  struct ArrayLayout {
    enum class State : uint8_t { kUnknown, kDirect, kOff };
    State state = State::kUnknown;
    Py_ssize_t aval = -1, sharding = -1, committed = -1;
    unsigned int version_tag = 0;  // of the type when learnt
    int attempts = 0;
    bool learning = false;  // samples being read (their code may call us)
  };

  struct ArrayReaders {
    PyTypeObject* type;
    // Mutable caches inside (descriptor, version tag); the GIL serialises.
    mutable AttrReader aval, sharding, committed;
    mutable ArrayLayout layout;
  };

  // A tree structure read by Key: one code per node (0 leaf, 1 tuple,
  // 2 list, 3 dict, 4 None; containers followed by their size), the dict
  // keys in order, and the treedef flatten() gave for it.
  struct TreeShape {
    std::vector<int32_t> code;
    std::vector<py::object> keys;
    py::object treedef;
    size_t treedef_hash = 0;
  };
  // Loads the words BuildLeaf reads from the jax Arrays among `count` leaves
  // (see LoadAhead in signature.cc).
  void LoadAhead(PyObject* const* leaves, Py_ssize_t count) const;
  // `leaves[i]`'s signature into `out[i]`, loading ahead in blocks.
  void BuildLeaves(PyObject* const* leaves, size_t count,
                   std::vector<LeafSignature>& out) const;

  struct KeyWalk;
  // Reads `node` into `walk`; false when it holds anything else than what
  // Key reads itself (the walk is then abandoned).
  bool WalkNode(PyObject* node, int depth, KeyWalk& walk) const;
  const TreeShape* FindShape(const KeyWalk& walk) const;

  // Finds r.layout from the samples (state kDirect or kOff afterwards).
  void LearnLayout(const ArrayReaders& r) const;
  void TryLearnLayout(const ArrayReaders& r) const;
  // Fills `out` from the fields at r.layout; false if they are unset.
  static bool ReadFields(const ArrayReaders& r, PyObject* obj,
                         LeafSignature& out);
  std::vector<py::object> array_types_;
  std::vector<ArrayReaders> array_readers_;  // one per array type
  // Tracer subclasses seen so far, each with its `aval` reader (held by
  // pointer: a getter may run Python code that adds a reader while another
  // is in use). Mutable cache; the GIL serialises access.
  mutable std::vector<std::pair<PyTypeObject*, std::unique_ptr<AttrReader>>>
      tracer_readers_;
  py::object tracer_type_;
  py::object ndarray_type_;
  py::object numpy_generic_type_;
  py::object fallback_;
  py::object array_samples_;
  py::object flatten_;
  // Tree structures seen by Key, by structure hash (emptied when full).
  mutable std::unordered_map<size_t, std::vector<TreeShape>> shapes_;
  mutable size_t shape_count_ = 0;
  py::object aval_name_;
  py::object shape_name_;
  py::object dtype_name_;
};

// A tuple with a cached hash. Built through ContextInterner.
class ContextKey {
 public:
  // May throw py::error_already_set when hashing `values` raises.
  explicit ContextKey(py::tuple values);
  size_t hash() const { return hash_; }
  const py::tuple& values() const { return values_; }
  bool Equals(const ContextKey& other) const;
  // True when `tuple` has the same length and the identical element objects.
  bool IdenticalTo(PyObject* tuple) const;

  int Traverse(visitproc visit, void* arg) const;
  void Clear() { values_ = py::tuple(); }

 private:
  py::tuple values_;
  size_t hash_;
};

// ---------------------------------------------------------- Python objects
//
// The extension's classes are plain CPython types whose objects hold the C++
// object inline (see _signature_module.cc for why). PyBox<T> is that layout.
template <typename T>
struct PyBox {
  PyObject_HEAD std::optional<T> value;  // empty only while being built

  // The C++ object of a PyBox<T> object, or nullptr before it is built.
  static T* Get(PyObject* self) {
    std::optional<T>& v = reinterpret_cast<PyBox*>(self)->value;
    return v ? &*v : nullptr;
  }

  // A new object of `type` (whose basicsize is sizeof(PyBox<T>)) holding
  // `value`; nullptr with a Python error set when allocation fails.
  static PyObject* New(PyTypeObject* type, T&& value) {
    PyObject* self = type->tp_alloc(type, 0);
    if (self == nullptr) return nullptr;
    new (&reinterpret_cast<PyBox*>(self)->value)
        std::optional<T>(std::move(value));
    return self;
  }
};

// Returns the same ContextKey object for tuples that are element-wise
// identical to one of the last `capacity` tuples seen; JAX's trace context
// tuple is rebuilt on every call but its elements are the same objects while
// no config changes, so the usual cost is a pointer compare per element.
class ContextInterner {
 public:
  // key_type: the Python type of ContextKey objects (a PyBox<ContextKey>).
  ContextInterner(size_t capacity, PyTypeObject* key_type);
  // A new reference to the key object for `values` (a tuple; TypeError
  // otherwise).
  py::object Intern(py::handle values);
  size_t size() const { return recent_.size(); }

  int Traverse(visitproc visit, void* arg) const;
  void Clear() { recent_.clear(); }

 private:
  size_t capacity_;
  py::object key_type_;
  std::vector<py::object> recent_;  // key objects, most recent first
};

}  // namespace jaxworks::jit_cache

#endif  // JAXWORKS_JIT_CACHE_CC_SIGNATURE_H_
