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

}  // namespace jaxworks::cc

#endif  // JAXWORKS_TOOLS_CC_ATTR_READER_H_
