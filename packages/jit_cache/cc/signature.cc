#include "signature.h"

#include <Python.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <utility>

namespace jaxworks::jit_cache {

namespace {

// Hash of an object that is compared by identity or whose identity is a good
// proxy (types, interned avals): its address, no Python call.
size_t PointerHash(const void* p) {
  return static_cast<size_t>(reinterpret_cast<uintptr_t>(p)) >> 4;
}

// Odd 64-bit constants (xxHash64's primes) for the cheap per-leaf summaries.
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;

// One xxHash64-style accumulation round: `value * kP2` does not depend on
// `acc`, so consecutive rounds overlap in the CPU.
size_t HashRound(size_t acc, size_t value) {
  uint64_t a = static_cast<uint64_t>(acc) + static_cast<uint64_t>(value) * kP2;
  a = (a << 31) | (a >> 33);
  return static_cast<size_t>(a * kP1);
}

size_t PyHash(py::handle obj) {
  Py_hash_t h = PyObject_Hash(obj.ptr());
  if (h == -1 && PyErr_Occurred()) throw py::error_already_set();
  return static_cast<size_t>(h);
}

// `a == b` with Python semantics (identity first; two nulls are equal);
// throws if __eq__ raises.
bool PyEqual(const py::object& a, const py::object& b) {
  if (a.ptr() == b.ptr()) return true;
  if (!a || !b) return false;
  int r = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

py::object GetAttr(py::handle obj, const py::object& name) {
  PyObject* r = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

[[noreturn]] void ThrowTypeError(const std::string& message) {
  PyErr_SetString(PyExc_TypeError, message.c_str());
  throw py::error_already_set();
}

std::string TypeName(py::handle obj) {
  return std::string(Py_TYPE(obj.ptr())->tp_name);
}

}  // namespace

const char* LeafKindName(LeafKind kind) {
  switch (kind) {
    case LeafKind::kJaxArray:
      return "jax_array";
    case LeafKind::kTracer:
      return "tracer";
    case LeafKind::kNdarray:
      return "ndarray";
    case LeafKind::kNumpyScalar:
      return "numpy_scalar";
    case LeafKind::kPyBool:
      return "bool";
    case LeafKind::kPyInt:
      return "int";
    case LeafKind::kPyFloat:
      return "float";
    case LeafKind::kPyComplex:
      return "complex";
    case LeafKind::kOther:
      return "other";
  }
  return "other";
}

size_t CombineHash(size_t seed, size_t value) {
  // 64-bit mix (splitmix64 finaliser) folded into the seed.
  uint64_t x = static_cast<uint64_t>(value) + 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return static_cast<size_t>(seed * 31u) ^ static_cast<size_t>(x);
}

// ----------------------------------------------------------------- Signature

Signature::Signature(std::vector<LeafSignature> leaves, py::object extra)
    : leaves_(std::move(leaves)), extra_(std::move(extra)), has_tracer_(false) {
  // One cheap round per leaf (the leaf summaries are not mixed), one full mix
  // at the end.
  size_t h = CombineHash(leaves_.size(), PyHash(extra_));
  for (const LeafSignature& leaf : leaves_) {
    h = HashRound(h, leaf.hash);
    has_tracer_ |= leaf.kind == LeafKind::kTracer;
  }
  hash_ = CombineHash(h, 0);
}

Signature::Signature(std::vector<LeafSignature> leaves, py::object extra,
                     size_t extra_hash)
    : leaves_(std::move(leaves)), extra_(std::move(extra)), has_tracer_(false) {
  size_t h = CombineHash(leaves_.size(), extra_hash);
  for (const LeafSignature& leaf : leaves_) {
    h = HashRound(h, leaf.hash);
    has_tracer_ |= leaf.kind == LeafKind::kTracer;
  }
  hash_ = CombineHash(h, 0);
}

bool Signature::Equals(const Signature& other) const {
  if (this == &other) return true;
  if (hash_ != other.hash_ || leaves_.size() != other.leaves_.size()) {
    return false;
  }
  for (size_t i = 0; i < leaves_.size(); ++i) {
    const LeafSignature& a = leaves_[i];
    const LeafSignature& b = other.leaves_[i];
    if (a.kind != b.kind || a.committed != b.committed || a.hash != b.hash) {
      return false;
    }
  }
  // Cheap fields agree; now the Python-level comparisons.
  for (size_t i = 0; i < leaves_.size(); ++i) {
    const LeafSignature& a = leaves_[i];
    const LeafSignature& b = other.leaves_[i];
    if (!PyEqual(a.first, b.first) || !PyEqual(a.second, b.second)) {
      return false;
    }
  }
  return PyEqual(extra_, other.extra_);
}

py::list Signature::Describe() const {
  py::list out;
  for (const LeafSignature& leaf : leaves_) {  // (null after a GC clear)
    py::object first = leaf.first ? leaf.first : py::none();
    py::object second = leaf.second ? leaf.second : py::none();
    out.append(
        py::make_tuple(LeafKindName(leaf.kind), first, second, leaf.committed));
  }
  return out;
}

int Signature::Traverse(visitproc visit, void* arg) const {
  for (const LeafSignature& leaf : leaves_) {
    Py_VISIT(leaf.first.ptr());
    Py_VISIT(leaf.second.ptr());
  }
  Py_VISIT(extra_.ptr());
  return 0;
}

void Signature::Clear() {
  // Keep kinds and hashes (the object stays hashable); drop the references.
  for (LeafSignature& leaf : leaves_) {
    leaf.first = py::object();
    leaf.second = py::object();
  }
  extra_ = py::object();
}

std::string Signature::Repr() const {
  std::string kinds;
  for (size_t i = 0; i < leaves_.size() && i < 8; ++i) {
    if (i) kinds += ", ";
    kinds += LeafKindName(leaves_[i].kind);
  }
  if (leaves_.size() > 8) kinds += ", ...";
  return "Signature(" + std::to_string(leaves_.size()) + " leaves: [" + kinds +
         "])";
}

// ---------------------------------------------------------- SignatureBuilder

SignatureBuilder::SignatureBuilder(py::tuple array_types,
                                   py::object tracer_type,
                                   py::object ndarray_type,
                                   py::object numpy_generic_type,
                                   py::object fallback,
                                   py::object array_samples, py::object flatten)
    : tracer_type_(std::move(tracer_type)),
      ndarray_type_(std::move(ndarray_type)),
      numpy_generic_type_(std::move(numpy_generic_type)),
      fallback_(std::move(fallback)),
      array_samples_(std::move(array_samples)),
      flatten_(std::move(flatten)),
      aval_name_(py::str("aval")),
      shape_name_(py::str("shape")),
      dtype_name_(py::str("dtype")) {
  py::str sharding_name("_sharding"), committed_name("_committed");
  for (py::handle t : array_types) {
    if (!PyType_Check(t.ptr())) {
      ThrowTypeError("SignatureBuilder: array_types must hold types, got " +
                     TypeName(t));
    }
    array_types_.push_back(py::reinterpret_borrow<py::object>(t));
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>(t.ptr());
    array_readers_.push_back(ArrayReaders{type, AttrReader(type, aval_name_),
                                          AttrReader(type, sharding_name),
                                          AttrReader(type, committed_name)});
  }
  for (const py::object* t :
       {&tracer_type_, &ndarray_type_, &numpy_generic_type_}) {
    if (!t->is_none() && !PyType_Check(t->ptr())) {
      ThrowTypeError("SignatureBuilder: expected a type or None, got " +
                     TypeName(*t));
    }
  }
  if (!flatten_.is_none() && !PyCallable_Check(flatten_.ptr())) {
    ThrowTypeError("SignatureBuilder: flatten must be callable or None, got " +
                   TypeName(flatten_));
  }
  if (!array_samples_.is_none() && !PyCallable_Check(array_samples_.ptr())) {
    ThrowTypeError(
        "SignatureBuilder: array_samples must be callable or None, got " +
        TypeName(array_samples_));
  }
  if (!fallback_.is_none() && !PyCallable_Check(fallback_.ptr())) {
    ThrowTypeError("SignatureBuilder: fallback must be callable or None, got " +
                   TypeName(fallback_));
  }
}

LeafKind SignatureBuilder::Classify(py::handle leaf) const {
  PyObject* obj = leaf.ptr();
  PyTypeObject* type = Py_TYPE(obj);
  for (const ArrayReaders& r : array_readers_) {
    if (type == r.type) return LeafKind::kJaxArray;
  }
  if (type == &PyFloat_Type) return LeafKind::kPyFloat;
  if (type == &PyLong_Type) return LeafKind::kPyInt;
  if (type == &PyBool_Type) return LeafKind::kPyBool;
  if (type == &PyComplex_Type) return LeafKind::kPyComplex;
  if (!tracer_type_.is_none() &&
      PyType_IsSubtype(type,
                       reinterpret_cast<PyTypeObject*>(tracer_type_.ptr()))) {
    return LeafKind::kTracer;
  }
  if (!ndarray_type_.is_none() &&
      reinterpret_cast<PyObject*>(type) == ndarray_type_.ptr()) {
    return LeafKind::kNdarray;
  }
  if (!numpy_generic_type_.is_none() &&
      PyType_IsSubtype(
          type, reinterpret_cast<PyTypeObject*>(numpy_generic_type_.ptr()))) {
    return LeafKind::kNumpyScalar;
  }
  return LeafKind::kOther;
}

AttrReader& SignatureBuilder::TracerAvalReader(PyTypeObject* type) const {
  for (auto& [t, reader] : tracer_readers_) {
    if (t == type) return *reader;
  }
  tracer_readers_.emplace_back(type,
                               std::make_unique<AttrReader>(type, aval_name_));
  return *tracer_readers_.back().second;
}

void SignatureBuilder::TracerLeaf(AttrReader& aval, PyObject* obj,
                                  LeafSignature& out) const {
  // Only the abstract value: tracers of different values share a key. Avals
  // are interned by JAX: identity is a sound hash (a non-interned aval type
  // could only cost a miss, never a wrong hit).
  out.kind = LeafKind::kTracer;
  out.first = aval(obj);
  out.hash = static_cast<size_t>(out.kind) + PointerHash(out.first.ptr()) * kP1;
}

namespace {

PyObject* WordAt(PyObject* obj, Py_ssize_t offset) {
  PyObject* value;
  std::memcpy(&value, reinterpret_cast<const char*>(obj) + offset,
              sizeof(value));
  return value;
}

unsigned char ByteAt(PyObject* obj, Py_ssize_t offset) {
  return *(reinterpret_cast<const unsigned char*>(obj) + offset);
}

// The first pointer-aligned offset in [from, end) holding `target`; -1 if
// none.
Py_ssize_t FindWord(PyObject* obj, Py_ssize_t from, Py_ssize_t end,
                    PyObject* target) {
  constexpr Py_ssize_t kWord = static_cast<Py_ssize_t>(sizeof(PyObject*));
  for (Py_ssize_t off = from; off + kWord <= end; off += kWord) {
    if (WordAt(obj, off) == target) return off;
  }
  return -1;
}

// The leaf hash of a jax Array.
size_t ArrayLeafHash(const LeafSignature& out) {
  // Avals are interned by JAX, so identity is a sound hash. The sharding is
  // left out of the hash (hashing it costs a Python call) and compared in
  // Equals; arguments that differ only in sharding share a bucket.
  return static_cast<size_t>(out.kind) + PointerHash(out.first.ptr()) * kP1 +
         PointerHash(Py_TYPE(out.second.ptr())) * kP3 +
         (out.committed ? kP2 : 0);
}

}  // namespace

void SignatureBuilder::LearnLayout(const ArrayReaders& r) const {
  r.layout.state = ArrayLayout::State::kOff;  // while learning (Python runs)
  // A type changed again and again is read through its getters.
  if (array_samples_.is_none() || ++r.layout.attempts > 8) return;
  r.layout.learning = true;
  TryLearnLayout(r);
  r.layout.learning = false;
  // Tried again when the type changes (the tag is 0 until it is next used).
  if (r.layout.state != ArrayLayout::State::kDirect) {
    r.layout.version_tag = r.type->tp_version_tag;
  }
}

void SignatureBuilder::TryLearnLayout(const ArrayReaders& r) const {
  using State = ArrayLayout::State;
  constexpr Py_ssize_t kWord = static_cast<Py_ssize_t>(sizeof(PyObject*));
  const Py_ssize_t size = r.type->tp_basicsize;
  PyObject* samples = PyObject_CallNoArgs(array_samples_.ptr());
  if (samples == nullptr || !PyList_Check(samples)) {
    PyErr_Clear();
    Py_XDECREF(samples);
    return;
  }
  py::object owner = py::reinterpret_steal<py::object>(samples);
  ArrayLayout layout;
  bool seen[2] = {false, false};
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(samples); ++i) {
    PyObject* obj = PyList_GET_ITEM(samples, i);
    if (Py_TYPE(obj) != r.type) return;
    PyObject* aval = r.aval.Read(obj);
    PyObject* sharding = aval == nullptr ? nullptr : r.sharding.Read(obj);
    PyObject* committed = sharding == nullptr ? nullptr : r.committed.Read(obj);
    py::object hold[] = {py::reinterpret_steal<py::object>(aval),
                         py::reinterpret_steal<py::object>(sharding),
                         py::reinterpret_steal<py::object>(committed)};
    if (committed == nullptr ||
        (committed != Py_True && committed != Py_False)) {
      PyErr_Clear();
      return;
    }
    if (layout.aval < 0) {  // the first sample places the fields
      layout.aval =
          FindWord(obj, static_cast<Py_ssize_t>(sizeof(PyObject)), size, aval);
      if (layout.aval < 0) return;
      layout.sharding = FindWord(obj, layout.aval + kWord, size, sharding);
      if (layout.sharding < 0) return;
      layout.committed = layout.sharding + 2 * kWord;
      if (layout.committed >= size) return;
    }
    const unsigned char flag = ByteAt(obj, layout.committed);
    if (WordAt(obj, layout.aval) != aval ||
        WordAt(obj, layout.sharding) != sharding || flag > 1 ||
        (flag == 1) != (committed == Py_True)) {
      return;
    }
    seen[flag] = true;
  }
  const unsigned int tag = r.type->tp_version_tag;
  if (seen[0] && seen[1] && tag != 0) {
    layout.state = State::kDirect;
    layout.version_tag = tag;
    layout.attempts = r.layout.attempts;
    layout.learning = true;  // (cleared by LearnLayout)
    r.layout = layout;
  }
}

// Leaves whose words are loaded together, ahead of their signatures.
constexpr Py_ssize_t kLoadBlock = 32;

// Loads the type words of `count` objects, their values discarded: the
// header lines of a block of children, fetched together (see LoadAhead).
void LoadTypes(PyObject* const* objects, Py_ssize_t count) {
  uintptr_t sink = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    sink ^= reinterpret_cast<uintptr_t>(Py_TYPE(objects[i]));
  }
  asm volatile("" : : "r"(sink));  // keeps the loads
}

void SignatureBuilder::LoadAhead(PyObject* const* leaves,
                                 Py_ssize_t count) const {
  // The arguments of a step are often cold (after a collection, or a step's
  // worth of other work): each jax Array's header, aval and sharding words lie
  // on three cache lines (a jaxlib Array is 680 bytes) of its own page. Read
  // one leaf at a time, the misses come one after another; loaded here in a
  // tight loop, a block's misses overlap (prefetch hints, tried instead,
  // measured no gain). Only arrays of the first array type with a learnt
  // layout are read; the loaded values are discarded.
  if (array_readers_.empty()) return;
  const ArrayReaders& r = array_readers_.front();
  if (r.layout.state != ArrayLayout::State::kDirect ||
      r.layout.version_tag != r.type->tp_version_tag) {
    return;
  }
  uintptr_t sink = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* leaf = leaves[i];
    if (Py_TYPE(leaf) != r.type) continue;
    sink ^= reinterpret_cast<uintptr_t>(WordAt(leaf, r.layout.aval)) ^
            reinterpret_cast<uintptr_t>(WordAt(leaf, r.layout.sharding)) ^
            ByteAt(leaf, r.layout.committed);
  }
  asm volatile("" : : "r"(sink));  // keeps the loads
}

void SignatureBuilder::BuildLeaves(PyObject* const* leaves, size_t count,
                                   std::vector<LeafSignature>& out) const {
  out.resize(count);
  const auto n = static_cast<Py_ssize_t>(count);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i % kLoadBlock == 0) LoadAhead(leaves + i, std::min(kLoadBlock, n - i));
    BuildLeaf(py::handle(leaves[i]), static_cast<size_t>(i),
              out[static_cast<size_t>(i)]);
  }
}

bool SignatureBuilder::ReadFields(const ArrayReaders& r, PyObject* obj,
                                  LeafSignature& out) {
  PyObject* aval = WordAt(obj, r.layout.aval);
  PyObject* sharding = WordAt(obj, r.layout.sharding);
  const unsigned char flag = ByteAt(obj, r.layout.committed);
  if (aval == nullptr || sharding == nullptr || flag > 1) return false;
  out.kind = LeafKind::kJaxArray;
  out.first = py::reinterpret_borrow<py::object>(aval);
  out.second = py::reinterpret_borrow<py::object>(sharding);
  out.committed = flag == 1;
  out.hash = ArrayLeafHash(out);
  return true;
}

void SignatureBuilder::BuildLeaf(py::handle leaf, size_t index,
                                 LeafSignature& out) const {
  PyObject* obj = leaf.ptr();
  // jax Arrays first: the common case at top level; three loads, or three
  // getter calls.
  for (const ArrayReaders& r : array_readers_) {
    if (Py_TYPE(obj) != r.type) continue;
    if (r.layout.state != ArrayLayout::State::kUnknown &&
        r.layout.version_tag != r.type->tp_version_tag &&
        r.layout.attempts <= 8 && !r.layout.learning) {
      r.layout.state = ArrayLayout::State::kUnknown;  // the type changed
    }
    if (r.layout.state == ArrayLayout::State::kUnknown) LearnLayout(r);
    if (r.layout.state == ArrayLayout::State::kDirect &&
        ReadFields(r, obj, out)) {
      return;
    }
    out.kind = LeafKind::kJaxArray;
    out.first = r.aval(obj);
    out.second = r.sharding(obj);
    PyObject* committed = r.committed.Read(obj);
    if (committed == nullptr) throw py::error_already_set();
    int truth = committed == Py_True    ? 1
                : committed == Py_False ? 0
                                        : PyObject_IsTrue(committed);
    Py_DECREF(committed);
    if (truth < 0) throw py::error_already_set();
    out.committed = truth == 1;
    out.hash = ArrayLeafHash(out);
    return;
  }
  // Tracers of a type seen before (a subclass check then): no Classify.
  for (auto& [type, reader] : tracer_readers_) {
    if (Py_TYPE(obj) == type) return TracerLeaf(*reader, obj, out);
  }
  out.kind = Classify(leaf);
  size_t h = static_cast<size_t>(out.kind);
  switch (out.kind) {
    case LeafKind::kJaxArray:  // handled above
      break;
    case LeafKind::kTracer:  // of a new tracer type
      return TracerLeaf(TracerAvalReader(Py_TYPE(obj)), obj, out);
    case LeafKind::kNdarray: {
      out.first = GetAttr(leaf, dtype_name_);
      out.second = GetAttr(leaf, shape_name_);
      // Each numpy dtype class (Float32DType, ...) is its own Python type.
      h += PointerHash(Py_TYPE(out.first.ptr())) * kP1 +
           PyHash(out.second) * kP3;
      break;
    }
    case LeafKind::kNumpyScalar: {
      out.first = py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(Py_TYPE(obj)));
      h += PointerHash(out.first.ptr()) * kP1;
      break;
    }
    case LeafKind::kPyBool:
    case LeafKind::kPyInt:
    case LeafKind::kPyFloat:
    case LeafKind::kPyComplex:
      break;
    case LeafKind::kOther: {
      if (fallback_.is_none()) {
        ThrowTypeError(
            "jaxworks.jit_cache signature: leaf " + std::to_string(index) +
            " has type " + TypeName(leaf) +
            ", which is not a jax Array, tracer, numpy array or Python "
            "scalar; mark the argument static or pass an array");
      }
      PyObject* key = PyObject_CallOneArg(fallback_.ptr(), obj);
      if (key == nullptr) throw py::error_already_set();
      out.first = py::reinterpret_steal<py::object>(key);
      Py_hash_t kh = PyObject_Hash(key);
      if (kh == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        ThrowTypeError(
            "jaxworks.jit_cache signature: the fallback returned an "
            "unhashable key of type " +
            TypeName(out.first) + " for leaf " + std::to_string(index) +
            " of type " + TypeName(leaf));
      }
      h += static_cast<size_t>(kh) * kP1;
      break;
    }
  }
  out.hash = h;
}

Signature SignatureBuilder::Build(py::handle leaves, py::object extra) const {
  PyObject* seq = leaves.ptr();
  const bool is_list = PyList_Check(seq);
  if (!is_list && !PyTuple_Check(seq)) {
    ThrowTypeError(
        "jaxworks.jit_cache signature: leaves must be a list or tuple, got " +
        TypeName(leaves));
  }
  std::vector<LeafSignature> out;
  out.reserve(static_cast<size_t>(Py_SIZE(seq)));
  // Re-read the size on every step: a fallback or a property may run Python
  // code that mutates a list while we walk it.
  for (Py_ssize_t i = 0; i < Py_SIZE(seq); ++i) {
    if (i % kLoadBlock == 0) {  // the items as they are now (see above)
      LoadAhead(is_list ? reinterpret_cast<PyListObject*>(seq)->ob_item + i
                        : &PyTuple_GET_ITEM(seq, i),
                std::min(kLoadBlock, Py_SIZE(seq) - i));
    }
    py::object item = py::reinterpret_borrow<py::object>(
        is_list ? PyList_GET_ITEM(seq, i) : PyTuple_GET_ITEM(seq, i));
    out.emplace_back();  // filled in place: no temporary to move and destroy
    BuildLeaf(item, static_cast<size_t>(i), out.back());
  }
  return Signature(std::move(out), std::move(extra));
}

// ------------------------------------------------------------------- Key

namespace {

constexpr int32_t kLeafCode = 0, kTupleCode = 1, kListCode = 2, kDictCode = 3,
                  kNoneCode = 4;
// Deeper trees are flattened by `flatten` (JAX recurses as deep as Python).
constexpr int kMaxDepth = 64;
// Tree structures kept by one builder before the memo is emptied.
constexpr size_t kMaxShapes = 4096;

}  // namespace

// Room for `extra` more elements, growing geometrically.
template <typename T>
void Grow(std::vector<T>& v, size_t extra) {
  if (v.capacity() - v.size() < extra) {
    v.reserve(std::max(v.size() + extra, 2 * v.capacity()));
  }
}

struct SignatureBuilder::KeyWalk {
  std::vector<int32_t> code;
  std::vector<PyObject*> keys;        // borrowed from key_lists
  std::vector<py::object> key_lists;  // sorted key lists of the dicts
  std::vector<PyObject*> leaves;      // owned (released into the leaf list)
  std::vector<LeafSignature> sigs;
  size_t hash = 0;

  KeyWalk() = default;
  KeyWalk(const KeyWalk&) = delete;
  KeyWalk& operator=(const KeyWalk&) = delete;
  ~KeyWalk() {
    for (PyObject* leaf : leaves) Py_DECREF(leaf);
  }

  void Emit(int32_t tag, Py_ssize_t size = -1) {
    code.push_back(tag);
    size_t h = static_cast<size_t>(tag);
    if (size >= 0) {
      code.push_back(static_cast<int32_t>(size));
      h += static_cast<size_t>(size) << 8;
    }
    hash = HashRound(hash, h);
  }
};

bool SignatureBuilder::WalkNode(PyObject* node, int depth,
                                KeyWalk& walk) const {
  if (depth > kMaxDepth) return false;
  PyTypeObject* type = Py_TYPE(node);
  if (type == &PyTuple_Type || type == &PyList_Type) {
    const bool tuple = type == &PyTuple_Type;
    // Held: a leaf's getter may run Python code that drops a list.
    py::object hold = py::reinterpret_borrow<py::object>(node);
    const Py_ssize_t n = Py_SIZE(node);
    if (n > INT32_MAX) return false;
    walk.Emit(tuple ? kTupleCode : kListCode, n);
    Grow(walk.code, static_cast<size_t>(n));
    Grow(walk.leaves, static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (Py_SIZE(node) != n) return false;  // a list changed meanwhile
      if (i % kLoadBlock == 0) {  // the children's headers, misses overlapped
        LoadTypes(tuple ? &PyTuple_GET_ITEM(node, i)
                        : reinterpret_cast<PyListObject*>(node)->ob_item + i,
                  std::min(kLoadBlock, n - i));
      }
      PyObject* child =
          tuple ? PyTuple_GET_ITEM(node, i) : PyList_GET_ITEM(node, i);
      if (!WalkNode(child, depth + 1, walk)) return false;
    }
    return true;
  }
  if (type == &PyDict_Type) {
    py::object hold = py::reinterpret_borrow<py::object>(node);
    PyObject* keys = PyDict_Keys(node);
    if (keys == nullptr) throw py::error_already_set();
    walk.key_lists.push_back(py::reinterpret_steal<py::object>(keys));
    const Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n > INT32_MAX) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      // JAX sorts a dict's keys; str keys sort as Python sorts them.
      if (!PyUnicode_CheckExact(PyList_GET_ITEM(keys, i))) return false;
    }
    if (n > 1 && PyList_Sort(keys) < 0) throw py::error_already_set();
    walk.Emit(kDictCode, n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* key = PyList_GET_ITEM(keys, i);
      walk.keys.push_back(key);
      walk.hash = HashRound(walk.hash, static_cast<size_t>(PyHash(key)));
      PyObject* child = PyDict_GetItemWithError(node, key);
      if (child == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        return false;  // the dict changed meanwhile
      }
      if (!WalkNode(child, depth + 1, walk)) return false;
    }
    return true;
  }
  if (node == Py_None) {
    walk.Emit(kNoneCode);
    return true;
  }
  // A leaf, if of a kind the builder knows: anything else may be a pytree
  // node registered with JAX (only `flatten` knows).
  bool known = false;
  for (const ArrayReaders& r : array_readers_) known |= type == r.type;
  if (!known) known = Classify(node) != LeafKind::kOther;
  if (!known) return false;
  walk.Emit(kLeafCode);
  walk.leaves.push_back(node);
  Py_INCREF(node);
  return true;
}

const SignatureBuilder::TreeShape* SignatureBuilder::FindShape(
    const KeyWalk& walk) const {
  auto it = shapes_.find(walk.hash);
  if (it == shapes_.end()) return nullptr;
  for (const TreeShape& shape : it->second) {
    if (shape.code != walk.code || shape.keys.size() != walk.keys.size()) {
      continue;
    }
    bool same = true;
    for (size_t i = 0; same && i < walk.keys.size(); ++i) {
      PyObject* a = shape.keys[i].ptr();
      PyObject* b = walk.keys[i];
      same = a == b || PyUnicode_Compare(a, b) == 0;  // exact strs
    }
    if (same) return &shape;
  }
  return nullptr;
}

SignatureBuilder::KeyResult SignatureBuilder::Key(py::handle tree,
                                                  py::object statics,
                                                  py::object ctx) const {
  if (flatten_.is_none()) {
    ThrowTypeError("SignatureBuilder.key: the builder has no flatten");
  }
  KeyWalk walk;
  const bool walked = WalkNode(tree.ptr(), 0, walk);
  // The leaves' signatures after the walk, in blocks (BuildLeaves).
  if (walked) BuildLeaves(walk.leaves.data(), walk.leaves.size(), walk.sigs);
  py::object treedef;
  size_t treedef_hash = 0;
  std::vector<LeafSignature> sigs;
  py::object leaves;
  const TreeShape* shape = walked ? FindShape(walk) : nullptr;
  if (shape != nullptr) {
    treedef = shape->treedef;
    treedef_hash = shape->treedef_hash;
  } else {
    PyObject* flat = PyObject_CallOneArg(flatten_.ptr(), tree.ptr());
    if (flat == nullptr) throw py::error_already_set();
    py::object owner = py::reinterpret_steal<py::object>(flat);
    if (!PyTuple_Check(flat) || PyTuple_GET_SIZE(flat) != 2 ||
        !PyList_Check(PyTuple_GET_ITEM(flat, 0))) {
      ThrowTypeError(
          "SignatureBuilder.key: flatten must return (list of leaves, "
          "treedef)");
    }
    leaves = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(flat, 0));
    treedef = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(flat, 1));
    treedef_hash = PyHash(treedef);
    // The walk is used (and its shape kept) only when it found exactly the
    // leaves flatten did.
    bool agree = walked && static_cast<size_t>(PyList_GET_SIZE(leaves.ptr())) ==
                               walk.leaves.size();
    for (size_t i = 0; agree && i < walk.leaves.size(); ++i) {
      agree = PyList_GET_ITEM(leaves.ptr(), i) == walk.leaves[i];
    }
    if (agree) {
      sigs = std::move(walk.sigs);
      if (shape_count_ >= kMaxShapes) {
        shapes_.clear();
        shape_count_ = 0;
      }
      TreeShape fresh;
      fresh.code = walk.code;
      for (PyObject* key : walk.keys) {
        fresh.keys.push_back(py::reinterpret_borrow<py::object>(key));
      }
      fresh.treedef = treedef;
      fresh.treedef_hash = treedef_hash;
      shapes_[walk.hash].push_back(std::move(fresh));
      ++shape_count_;
    } else {
      Signature built = Build(leaves, py::none());
      sigs = std::vector<LeafSignature>(built.leaves());
    }
  }
  if (!leaves) {  // from the memo: the walk's leaves
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(walk.leaves.size()));
    if (list == nullptr) throw py::error_already_set();
    for (size_t i = 0; i < walk.leaves.size(); ++i) {
      PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), walk.leaves[i]);
    }
    walk.leaves.clear();  // the list owns them now
    leaves = py::reinterpret_steal<py::object>(list);
    sigs = std::move(walk.sigs);
  }
  const size_t extra_hash =
      CombineHash(CombineHash(treedef_hash, PyHash(statics)), PyHash(ctx));
  PyObject* packed = PyTuple_Pack(3, treedef.ptr(), statics.ptr(), ctx.ptr());
  if (packed == nullptr) throw py::error_already_set();
  py::object extra = py::reinterpret_steal<py::object>(packed);
  return KeyResult{std::move(leaves), std::move(treedef),
                   Signature(std::move(sigs), std::move(extra), extra_hash)};
}

int SignatureBuilder::Traverse(visitproc visit, void* arg) const {
  for (const py::object& t : array_types_) Py_VISIT(t.ptr());
  for (const ArrayReaders& r : array_readers_) {
    for (const AttrReader* reader : {&r.aval, &r.sharding, &r.committed}) {
      if (int rc = reader->Traverse(visit, arg)) return rc;
    }
  }
  for (const auto& [type, reader] : tracer_readers_) {
    if (int rc = reader->Traverse(visit, arg)) return rc;
  }
  Py_VISIT(tracer_type_.ptr());
  Py_VISIT(ndarray_type_.ptr());
  Py_VISIT(numpy_generic_type_.ptr());
  Py_VISIT(fallback_.ptr());
  Py_VISIT(array_samples_.ptr());
  Py_VISIT(flatten_.ptr());
  for (const auto& [hash, shapes] : shapes_) {
    for (const TreeShape& shape : shapes) {
      Py_VISIT(shape.treedef.ptr());
      for (const py::object& key : shape.keys) Py_VISIT(key.ptr());
    }
  }
  return 0;
}

void SignatureBuilder::Clear() {
  // Afterwards every leaf is "other" without a fallback: a TypeError, never
  // a crash, should anything still call the builder.
  array_readers_.clear();
  array_types_.clear();
  tracer_readers_.clear();
  tracer_type_ = py::none();
  ndarray_type_ = py::none();
  numpy_generic_type_ = py::none();
  fallback_ = py::none();
  array_samples_ = py::none();
  flatten_ = py::none();
  shapes_.clear();
  shape_count_ = 0;
}

// ---------------------------------------------------------------- ContextKey

ContextKey::ContextKey(py::tuple values)
    : values_(std::move(values)), hash_(PyHash(values_)) {}

bool ContextKey::Equals(const ContextKey& other) const {
  return hash_ == other.hash_ && PyEqual(values_, other.values_);
}

bool ContextKey::IdenticalTo(PyObject* tuple) const {
  const Py_ssize_t n = PyTuple_GET_SIZE(values_.ptr());
  if (PyTuple_GET_SIZE(tuple) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyTuple_GET_ITEM(tuple, i) != PyTuple_GET_ITEM(values_.ptr(), i)) {
      return false;
    }
  }
  return true;
}

int ContextKey::Traverse(visitproc visit, void* arg) const {
  Py_VISIT(values_.ptr());
  return 0;
}

ContextInterner::ContextInterner(size_t capacity, PyTypeObject* key_type)
    : capacity_(capacity == 0 ? 1 : capacity),
      key_type_(py::reinterpret_borrow<py::object>(
          reinterpret_cast<PyObject*>(key_type))) {}

py::object ContextInterner::Intern(py::handle values) {
  if (!PyTuple_Check(values.ptr())) {
    ThrowTypeError("ContextInterner: expected a tuple, got " +
                   TypeName(values));
  }
  for (size_t i = 0; i < recent_.size(); ++i) {
    const ContextKey* key = PyBox<ContextKey>::Get(recent_[i].ptr());
    if (key != nullptr && key->IdenticalTo(values.ptr())) {
      py::object hit = recent_[i];
      if (i != 0) {
        recent_.erase(recent_.begin() + static_cast<std::ptrdiff_t>(i));
        recent_.insert(recent_.begin(), hit);
      }
      return hit;
    }
  }
  // Hashing may run Python code: build the key before touching recent_.
  ContextKey key(py::reinterpret_borrow<py::tuple>(values));
  PyObject* obj = PyBox<ContextKey>::New(
      reinterpret_cast<PyTypeObject*>(key_type_.ptr()), std::move(key));
  if (obj == nullptr) throw py::error_already_set();
  py::object result = py::reinterpret_steal<py::object>(obj);
  recent_.insert(recent_.begin(), result);
  if (recent_.size() > capacity_) recent_.pop_back();
  return result;
}

int ContextInterner::Traverse(visitproc visit, void* arg) const {
  for (const py::object& key : recent_) Py_VISIT(key.ptr());
  Py_VISIT(key_type_.ptr());
  return 0;
}

}  // namespace jaxworks::jit_cache
