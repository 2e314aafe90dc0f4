# Structured outputs (include/tandem/grammar.hpp) use xgrammar's C++ core (Apache-2.0,
# https://github.com/mlc-ai/xgrammar). Its PyPI sdist carries the sources; it is downloaded
# once at configure time (pinned version and SHA-256) into the cache
# ${TANDEM_CACHE:-${XDG_CACHE_HOME:-~/.cache}/tandem}/deps, or taken from
# TANDEM_XGRAMMAR_SDIST (a local copy of the same file). Only the core library is built
# (cpp/*.cc with picojson and dlpack headers), not its Python bindings.
#
# TANDEM_GRAMMAR: AUTO (default) builds it when the sdist can be had and reports the feature
# off otherwise (Grammar::available() false, the grammar tests SKIPPED); ON requires it;
# OFF skips it. Sets TANDEM_HAVE_GRAMMAR and, when ON, the target tandem_xgrammar.
set(TANDEM_GRAMMAR AUTO CACHE STRING "Structured outputs with xgrammar: AUTO, ON or OFF")
set_property(CACHE TANDEM_GRAMMAR PROPERTY STRINGS AUTO ON OFF)
set(TANDEM_XGRAMMAR_SDIST "" CACHE FILEPATH "A local copy of the xgrammar sdist (skips the download)")

set(TANDEM_HAVE_GRAMMAR OFF)
set(_xg_version 0.2.9)
set(_xg_sha256 87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90)
set(_xg_url "https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-${_xg_version}.tar.gz")

function(_tandem_xgrammar_fail why)
  if(TANDEM_GRAMMAR STREQUAL "ON")
    message(FATAL_ERROR "TANDEM_GRAMMAR=ON but ${why}")
  endif()
  message(WARNING "Tandem: structured outputs OFF: ${why}")
endfunction()

if(NOT TANDEM_GRAMMAR STREQUAL "OFF")
  if(TANDEM_XGRAMMAR_SDIST)
    set(_xg_archive "${TANDEM_XGRAMMAR_SDIST}")
  else()
    if(DEFINED ENV{TANDEM_CACHE})
      set(_xg_cache "$ENV{TANDEM_CACHE}/deps")
    elseif(DEFINED ENV{XDG_CACHE_HOME})
      set(_xg_cache "$ENV{XDG_CACHE_HOME}/tandem/deps")
    else()
      set(_xg_cache "$ENV{HOME}/.cache/tandem/deps")
    endif()
    set(_xg_archive "${_xg_cache}/xgrammar-${_xg_version}.tar.gz")
  endif()
  set(_xg_ok OFF)
  if(EXISTS "${_xg_archive}")
    file(SHA256 "${_xg_archive}" _xg_have)
    if(_xg_have STREQUAL _xg_sha256)
      set(_xg_ok ON)
    endif()
  endif()
  if(NOT _xg_ok AND NOT TANDEM_XGRAMMAR_SDIST)
    message(STATUS "Tandem: downloading xgrammar ${_xg_version} (sdist) from PyPI")
    file(DOWNLOAD "${_xg_url}" "${_xg_archive}.part" EXPECTED_HASH SHA256=${_xg_sha256}
         TIMEOUT 120 INACTIVITY_TIMEOUT 30 STATUS _xg_status)
    list(GET _xg_status 0 _xg_code)
    if(_xg_code EQUAL 0)
      file(RENAME "${_xg_archive}.part" "${_xg_archive}")
      set(_xg_ok ON)
    else()
      file(REMOVE "${_xg_archive}.part")
      list(GET _xg_status 1 _xg_msg)
      set(_xg_why "cannot download ${_xg_url} (${_xg_msg})")
    endif()
  elseif(NOT _xg_ok)
    set(_xg_why "${_xg_archive} is not xgrammar ${_xg_version}'s sdist (SHA-256 differs)")
  endif()
  if(_xg_ok)
    set(_xg_src "${CMAKE_BINARY_DIR}/_deps/xgrammar-${_xg_version}")
    if(NOT EXISTS "${_xg_src}/cpp/grammar_matcher.cc")
      file(ARCHIVE_EXTRACT INPUT "${_xg_archive}" DESTINATION "${CMAKE_BINARY_DIR}/_deps")
    endif()
    file(GLOB_RECURSE _xg_sources "${_xg_src}/cpp/*.cc")
    list(FILTER _xg_sources EXCLUDE REGEX "/cpp/tvm_ffi/.*\\.cc$")
    add_library(tandem_xgrammar STATIC ${_xg_sources})
    # Third-party code: C++17 as upstream builds it, optimised even in Debug (mask
    # computation is per token), its warnings not ours.
    set_target_properties(tandem_xgrammar PROPERTIES CXX_STANDARD 17 CXX_EXTENSIONS OFF)
    target_compile_options(tandem_xgrammar PRIVATE -w -O2)
    target_compile_definitions(tandem_xgrammar PUBLIC XGRAMMAR_ENABLE_CPPTRACE=0 XGRAMMAR_ENABLE_INTERNAL_CHECK=0)
    target_include_directories(tandem_xgrammar PUBLIC "${_xg_src}/include")
    target_include_directories(tandem_xgrammar SYSTEM PUBLIC "${_xg_src}/3rdparty/picojson"
                                                            "${_xg_src}/3rdparty/dlpack/include")
    target_link_libraries(tandem_xgrammar PUBLIC Threads::Threads)
    set(TANDEM_HAVE_GRAMMAR ON)
  else()
    _tandem_xgrammar_fail("${_xg_why}")
  endif()
endif()
message(STATUS "Tandem: structured outputs (xgrammar) ${TANDEM_HAVE_GRAMMAR}")
