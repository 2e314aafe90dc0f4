# ctest c_abi_hpp_coverage: the header-only C++ layer cabi/include/tandem.hpp wraps every
# function of the C ABI. Each name in cabi/abi/tandem.symbols must be called in tandem.hpp
# (`name(`) or passed as a template argument (`name>`, the *_free functions of the handle
# owners), outside comments.
# Usage: cmake -DSYMBOLS=tandem.symbols -DHPP=tandem.hpp -P check_hpp_coverage.cmake
file(STRINGS ${SYMBOLS} symbols REGEX "^[^#]")
file(READ ${HPP} code)
string(REGEX REPLACE "//[^\n]*" "" code "${code}")
set(missing "")
foreach(name IN LISTS symbols)
  if(NOT code MATCHES "[^a-z0-9_]${name}[(>]")
    list(APPEND missing "${name}")
  endif()
endforeach()
list(LENGTH symbols n)
if(missing)
  message(FATAL_ERROR "${HPP} does not wrap these C functions of ${SYMBOLS}: ${missing}")
endif()
message(STATUS "${HPP} wraps all ${n} C functions of ${SYMBOLS}")
