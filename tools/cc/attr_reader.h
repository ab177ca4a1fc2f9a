// Fast reads of one attribute of objects of one exact Python type.
//
// Shared by the jaxworks C++ extensions (jit_cache's argument signatures,
// batched_transfer's leaf grouping). Header-only: each extension compiles its
// own copy, so the separately versioned packages share the source, never a
// library at run time.
//
// An AttrReader looks the attribute up on the type once and keeps how to read
// it, skipping the generic attribute lookup on every read:
//   * a __slots__ member holding an object is loaded from the slot offset its
//     descriptor publishes (what member_get does);
//   * a property's getter is called through its vectorcall entry point;
//   * another data descriptor through its tp_descr_get.
// Only data descriptors win over an instance __dict__, so only those bypass
// the generic lookup; anything else (no data descriptor, a type that
// overrides __getattribute__, a name that is not an exact str) is read with
// PyObject_GetAttr. A type's __getattr__ (what Python calls when the lookup
// raises AttributeError) runs as it would under getattr().
//
// The lookup is redone whenever the type's version tag changes (an assignment
// to an attribute of the type or of a base class, such as a monkeypatched
// property), and on every read while the type has no valid tag, so a reader
// never serves a stale descriptor.
//
// Every function expects the GIL to be held. Include this header after the
// extension's own pybind11 settings
// (PYBIND11_NO_ASSERT_GIL_HELD_INCREF_DECREF).
#ifndef JAXWORKS_TOOLS_CC_ATTR_READER_H_
#define JAXWORKS_TOOLS_CC_ATTR_READER_H_

#include <Python.h>
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <utility>

namespace jaxworks::cc {

class AttrReader {
 public:
  // A reader that must be assigned before it is used.
  AttrReader() = default;

  // Reads `name` (a str) of objects whose exact type is `type`.
  AttrReader(PyTypeObject* type, pybind11::object name)
      : type_(pybind11::reinterpret_borrow<pybind11::object>(
            reinterpret_cast<PyObject*>(type))),
        name_(std::move(name)) {
    Refresh();
  }

  const pybind11::object& name() const { return name_; }

  // True when reads go through a property whose getter is native code (a
  // getter written in Python may compute what it returns). Looks the
  // attribute up again first if the type changed.
  bool NativeProperty() const {
    if (version_tag_ == 0 || Type()->tp_version_tag != version_tag_) {
      Refresh();
    }
    return direct_ && fget_ && !PyFunction_Check(fget_.ptr()) &&
           !PyMethod_Check(fget_.ptr());
  }

  // getattr(obj, name) as a new reference, or nullptr with a Python error set.
  // `obj` must be of exactly the reader's type.
  PyObject* Read(PyObject* obj) const {
    if (version_tag_ == 0 || Type()->tp_version_tag != version_tag_) {
      Refresh();
    }
    if (!direct_) return PyObject_GetAttr(obj, name_.ptr());
    PyObject* r = ReadDescriptor(obj);
    if (r == nullptr && getattr_hook_ &&
        PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      r = CallGetattrHook(obj);
    }
    return r;
  }

  // getattr(obj, name); throws pybind11::error_already_set on failure.
  pybind11::object operator()(pybind11::handle obj) const {
    PyObject* r = Read(obj.ptr());
    if (r == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(r);
  }

  // Garbage-collector support for an owner that is a Python object.
  int Traverse(visitproc visit, void* arg) const {
    Py_VISIT(type_.ptr());
    Py_VISIT(descr_.ptr());
    Py_VISIT(fget_.ptr());
    Py_VISIT(getattr_hook_.ptr());
    return 0;
  }

 private:
  // A __slots__ member of type "object, AttributeError when unset", and the
  // flag of members whose reads raise an audit event.
#ifdef Py_T_OBJECT_EX  // Python >= 3.12
  static constexpr int kObjectSlot = Py_T_OBJECT_EX;
  static constexpr int kAuditedRead = Py_AUDIT_READ;
#else
  static constexpr int kObjectSlot = T_OBJECT_EX;
  static constexpr int kAuditedRead = READ_RESTRICTED;
#endif

  PyTypeObject* Type() const {
    return reinterpret_cast<PyTypeObject*>(type_.ptr());
  }

  // Reads through the cached data descriptor.
  PyObject* ReadDescriptor(PyObject* obj) const {
    if (slot_offset_ >= 0) {
      PyObject* value = *reinterpret_cast<PyObject**>(
          reinterpret_cast<char*>(obj) + slot_offset_);
      if (value != nullptr) {
        Py_INCREF(value);
        return value;
      }  // an empty slot: the descriptor raises its AttributeError
      return get_(descr_.ptr(), obj, type_.ptr());
    }
    if (call_ != nullptr) {
      PyObject* r = call_(fget_.ptr(), &obj, 1, nullptr);
      if (r == nullptr && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_SystemError, "attribute getter failed");
      }
      return r;
    }
    if (fget_) return PyObject_Vectorcall(fget_.ptr(), &obj, 1, nullptr);
    return get_(descr_.ptr(), obj, type_.ptr());
  }

  // type(obj).__getattr__(obj, name), bound the way Python binds it.
  PyObject* CallGetattrHook(PyObject* obj) const {
    PyObject* hook = getattr_hook_.ptr();
    descrgetfunc get = Py_TYPE(hook)->tp_descr_get;
    if (get == nullptr) return PyObject_CallOneArg(hook, name_.ptr());
    PyObject* bound = get(hook, obj, type_.ptr());
    if (bound == nullptr) return nullptr;
    PyObject* r = PyObject_CallOneArg(bound, name_.ptr());
    Py_DECREF(bound);
    return r;
  }

  // Looks the attribute up on the type again. Never leaves an error set.
  void Refresh() const {
    PyTypeObject* type = Type();
    descr_ = pybind11::object();
    fget_ = pybind11::object();
    getattr_hook_ = pybind11::object();
    call_ = nullptr;
    get_ = nullptr;
    slot_offset_ = -1;
    direct_ = false;
    version_tag_ = 0;
    // _PyType_Lookup returns a borrowed reference or null, never an error.
    static PyObject* const getattribute =
        PyUnicode_InternFromString("__getattribute__");
    static PyObject* const getattr = PyUnicode_InternFromString("__getattr__");
    if (getattribute == nullptr || getattr == nullptr) {
      PyErr_Clear();
      return;  // out of memory once: always the generic lookup
    }
    PyObject* descr = PyUnicode_CheckExact(name_.ptr())
                          ? _PyType_Lookup(type, name_.ptr())
                          : nullptr;
    const bool generic_lookup =
        _PyType_Lookup(type, getattribute) ==
        _PyType_Lookup(&PyBaseObject_Type, getattribute);
    if (generic_lookup && descr != nullptr &&
        Py_TYPE(descr)->tp_descr_get != nullptr &&
        Py_TYPE(descr)->tp_descr_set != nullptr) {
      direct_ = true;
      descr_ = pybind11::reinterpret_borrow<pybind11::object>(descr);
      get_ = Py_TYPE(descr)->tp_descr_get;
      if (PyObject* hook = _PyType_Lookup(type, getattr)) {
        getattr_hook_ = pybind11::reinterpret_borrow<pybind11::object>(hook);
      }
      // A __slots__ member holding an object, readable without an audit hook.
      if (Py_TYPE(descr) == &PyMemberDescr_Type) {
        const PyMemberDef* member =
            reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
        if (member->type == kObjectSlot &&
            (member->flags & kAuditedRead) == 0) {
          slot_offset_ = member->offset;
        }
      }
      // A property: call its getter directly (property.__get__ forwards).
      if (Py_TYPE(descr) == &PyProperty_Type) {
        PyObject* fget = PyObject_GetAttrString(descr, "fget");
        if (fget == nullptr) {
          PyErr_Clear();
        } else if (fget == Py_None) {
          Py_DECREF(fget);
        } else {
          fget_ = pybind11::reinterpret_steal<pybind11::object>(fget);
          call_ = PyVectorcall_Function(fget);  // null: no vectorcall support
        }
      }
    }
    version_tag_ = type->tp_version_tag;  // 0: no valid tag, refresh next time
  }

  pybind11::object type_;  // keeps the type (and its pointer) alive
  pybind11::object name_;
  // The cached lookup, redone by Refresh (hence mutable: reads stay const).
  mutable pybind11::object descr_;         // the data descriptor, or null
  mutable pybind11::object fget_;          // its getter when it is a property
  mutable pybind11::object getattr_hook_;  // the type's __getattr__, or null
  mutable vectorcallfunc call_ = nullptr;  // fget_'s vectorcall entry point
  mutable descrgetfunc get_ = nullptr;     // the descriptor's tp_descr_get
  mutable Py_ssize_t slot_offset_ = -1;    // an object slot's offset, or -1
  mutable bool direct_ = false;            // read through the descriptor
  mutable unsigned int version_tag_ = 0;   // the type's tag when looked up
};

// Reads of one attribute of objects of one exact extension type, loaded from
// the instance's memory once the word holding it is known.
//
// Extension types such as jaxlib's Array and shardings keep the objects their
// property getters return in fields of the instance: the getter call costs
// 10-40 ns, a load 1. A FieldReader reads through its AttrReader until it has
// found the word of the instance holding the object the getter returned (the
// one word that does: a value found in two words is never learnt) and seen
// that word, alone, agree with the getter on kVerify objects in a row (each
// other than the one before); it then loads the word. It learns only:
//   * for a property with a native getter (AttrReader::NativeProperty);
//   * on types whose instances all have the same size (tp_itemsize 0), in the
//     words past the object header that are not the instance dict or weak
//     reference list.
// It reads through the getter for an object whose word is NULL; for good,
// once the word and the getter disagree while it learns; and it learns again
// when the type's version tag changes (a property replaced).
class FieldReader {
 public:
  static constexpr int kVerify = 4;

  FieldReader() = default;
  FieldReader(PyTypeObject* type, pybind11::object name)
      : reader_(type, std::move(name)), type_(type) {}

  const pybind11::object& name() const { return reader_.name(); }

  // True once reads load the learnt word (for tests and benchmarks).
  bool Direct() const {
    return state_ == State::kDirect && type_->tp_version_tag == tag_;
  }

  // getattr(obj, name) as a new reference, or nullptr with a Python error set.
  // `obj` must be of exactly the reader's type.
  PyObject* Read(PyObject* obj) const {
    if (state_ == State::kDirect) {
      if (type_->tp_version_tag == tag_) {
        PyObject* v = *reinterpret_cast<PyObject**>(
            reinterpret_cast<char*>(obj) + offset_);
        if (v != nullptr) {
          Py_INCREF(v);
          return v;
        }
        return reader_.Read(obj);
      }
      Restart();
    }
    PyObject* v = reader_.Read(obj);
    if (v != nullptr && state_ == State::kLearning) Learn(obj, v);
    return v;
  }

  // getattr(obj, name); throws pybind11::error_already_set on failure.
  pybind11::object operator()(pybind11::handle obj) const {
    PyObject* r = Read(obj.ptr());
    if (r == nullptr) throw pybind11::error_already_set();
    return pybind11::reinterpret_steal<pybind11::object>(r);
  }

 private:
  enum class State : unsigned char { kLearning, kDirect, kOff };
  static constexpr Py_ssize_t kWord = sizeof(PyObject*);

  static PyObject* WordAt(PyObject* obj, Py_ssize_t offset) {
    return *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  }

  bool Learnable(Py_ssize_t offset) const {
    return offset != type_->tp_dictoffset && offset != type_->tp_weaklistoffset;
  }

  void Restart() const {
    state_ = State::kLearning;
    offset_ = -1;
    agreed_ = 0;
    last_ = nullptr;
  }

  void Learn(PyObject* obj, PyObject* value) const {
    const unsigned int tag = type_->tp_version_tag;
    if (tag == 0 || type_->tp_itemsize != 0 || !reader_.NativeProperty()) {
      state_ = State::kOff;
      return;
    }
    if (tag != tag_) {  // first read, or the type changed while learning
      Restart();
      tag_ = tag;
    }
    Py_ssize_t found = -1;
    const Py_ssize_t end = type_->tp_basicsize;
    for (Py_ssize_t off = sizeof(PyObject); off + kWord <= end; off += kWord) {
      if (WordAt(obj, off) != value || !Learnable(off)) continue;
      if (found >= 0) {  // two words hold it: which one is the field?
        state_ = State::kOff;
        return;
      }
      found = off;
    }
    if (found < 0 || (offset_ >= 0 && found != offset_)) {
      state_ = State::kOff;
      return;
    }
    offset_ = found;
    if (obj != last_) {
      last_ = obj;
      if (++agreed_ >= kVerify) state_ = State::kDirect;
    }
  }

  AttrReader reader_;
  PyTypeObject* type_ = nullptr;  // held by reader_
  // What was learnt (mutable: reads stay const; the GIL serialises).
  mutable State state_ = State::kLearning;
  mutable Py_ssize_t offset_ = -1;
  mutable int agreed_ = 0;
  mutable PyObject* last_ = nullptr;  // compared only, never dereferenced
  mutable unsigned int tag_ = 0;
};

}  // namespace jaxworks::cc

#endif  // JAXWORKS_TOOLS_CC_ATTR_READER_H_
