# The library's modules: lib/<module>/ holds a module's sources and private headers,
# include/tandem/<module>/ its public headers. Each module lists the modules it may include;
# configuring fails when a file of a module includes a header of a module it does not list,
# so the layering (core at the bottom, the scheduler at the top) is enforced by the build.
#
#   core       errors, atomic files, thread pool
#   gguf       GGUF read/write, ggml block (de)quantisation
#   tokenizer  tokenizers, pre-tokenizers, Unicode tables
#   model      Model (hyper-parameters, weights, tokenizer), requantisation
#   template   the Jinja interpreter, chat templates, tool-call formats
#   grammar    constrained decoding (xgrammar): JSON schema, any JSON, GBNF
#   kv         paged KV store, page file, KV contract
#   exec       executor interface, the decoder layer (both executors), paced executor,
#              performance model; exec/cpu, exec/gpu
#   node       executor sets, executors and their KV stores sized by one page rule
#   session    session, session files, chat session, generation, sampler, stop strings
#   sched      scheduler, routing policy, speed signals, metrics, request handles
if(CMAKE_SCRIPT_MODE_FILE)  # run as a script (the build-time check): the project's policies
  cmake_minimum_required(VERSION 3.24)
endif()
set(TANDEM_MODULES core gguf tokenizer model template grammar kv exec exec/cpu exec/gpu node session sched)
set(TANDEM_MODULE_DEPS_core "")
set(TANDEM_MODULE_DEPS_gguf core)
set(TANDEM_MODULE_DEPS_tokenizer core gguf)
set(TANDEM_MODULE_DEPS_model core gguf tokenizer)
set(TANDEM_MODULE_DEPS_template core model tokenizer)
set(TANDEM_MODULE_DEPS_grammar core tokenizer)
set(TANDEM_MODULE_DEPS_kv core model)
set(TANDEM_MODULE_DEPS_exec core kv model)
set(TANDEM_MODULE_DEPS_exec/cpu core exec kv model)
set(TANDEM_MODULE_DEPS_exec/gpu core exec kv model)
set(TANDEM_MODULE_DEPS_node core exec exec/cpu exec/gpu kv model)
set(TANDEM_MODULE_DEPS_session core exec grammar kv model node template tokenizer)
set(TANDEM_MODULE_DEPS_sched core exec grammar kv model session tokenizer)

set(_tandem_modules_file ${CMAKE_CURRENT_LIST_FILE})

# The module an #include line names, in OUT ("" for none): "tandem/<module>/x.hpp" (public)
# or "<module>/x.hpp" (private, from lib/), in quotes or angle brackets, a comment before
# the name allowed, after normalising the path (repeated and ./ separators, dir/.. pairs)
# and dropping leading ../, include/, lib/ and tandem/: "../../include/tandem/sched/x.hpp",
# "core/../sched/x.hpp" and "../../lib/sched/x.hpp" all name sched.
function(_tandem_included_module line out)
  set(path "")
  if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*(/\\*[^*]*\\*/[ \t]*)*[\"<]([^\">]+)[\">]")
    set(path ${CMAKE_MATCH_2})
  endif()
  string(REGEX REPLACE "/+" "/" path "${path}")
  string(REGEX REPLACE "(^|/)(\\./)+" "\\1" path "${path}")
  while(path MATCHES "(^|/)[^/.][^/]*/\\.\\./")
    string(REGEX REPLACE "(^|/)[^/.][^/]*/\\.\\./" "\\1" path "${path}")
  endwhile()
  string(REGEX REPLACE "^(\\.\\./)+" "" path "${path}")
  string(REGEX REPLACE "^include/" "" path "${path}")
  string(REGEX REPLACE "^lib/" "" path "${path}")
  string(REGEX REPLACE "^tandem/" "" path "${path}")
  set(module "")
  if(path MATCHES "^([a-z_]+(/cpu|/gpu)?)/[^/]+$")
    set(module ${CMAKE_MATCH_1})
  endif()
  set(${out} ${module} PARENT_SCOPE)
endfunction()

# Fails for an include across modules that the including module does not declare above,
# and for a library file outside every module: at configure, and (target
# tandem_module_check, which the library depends on) at build time whenever a module's file
# changes. Sets TANDEM_MODULE_SOURCES. Also runs as a script: cmake -DTANDEM_ROOT=<src> -P
# cmake/TandemModules.cmake.
function(tandem_check_modules root)
  if(CMAKE_SCRIPT_MODE_FILE)
    set(configure_depends "")
  else()
    set(configure_depends CONFIGURE_DEPENDS)
  endif()
  set(all_sources "")
  set(all_files "")
  foreach(mod IN LISTS TANDEM_MODULES)
    file(GLOB files ${configure_depends} ${root}/lib/${mod}/*.cpp ${root}/lib/${mod}/*.hpp
         ${root}/include/tandem/${mod}/*.hpp)
    list(APPEND all_files ${files})
    set(allowed ${mod} ${TANDEM_MODULE_DEPS_${mod}})
    foreach(f IN LISTS files)
      if(f MATCHES "\\.cpp$")
        list(APPEND all_sources ${f})
      endif()
      file(STRINGS ${f} includes REGEX "^[ \t]*#[ \t]*include")
      foreach(line IN LISTS includes)
        _tandem_included_module("${line}" target)
        if(target IN_LIST TANDEM_MODULES AND NOT target IN_LIST allowed)
          file(RELATIVE_PATH rel ${root} ${f})
          message(FATAL_ERROR "${rel} (module ${mod}) includes ${target}/, which module ${mod} does not "
                              "declare (cmake/TandemModules.cmake: TANDEM_MODULE_DEPS_${mod})")
        endif()
      endforeach()
    endforeach()
  endforeach()
  file(GLOB_RECURSE every ${configure_depends} ${root}/lib/*.cpp)
  foreach(f IN LISTS every)
    if(NOT f IN_LIST all_sources)
      file(RELATIVE_PATH rel ${root} ${f})
      message(FATAL_ERROR "${rel} is in no module of cmake/TandemModules.cmake")
    endif()
  endforeach()
  if(NOT CMAKE_SCRIPT_MODE_FILE)
    set(stamp ${CMAKE_BINARY_DIR}/tandem-modules.stamp)
    add_custom_command(
      OUTPUT ${stamp}
      COMMAND ${CMAKE_COMMAND} -DTANDEM_ROOT=${root} -P ${_tandem_modules_file}
      COMMAND ${CMAKE_COMMAND} -E touch ${stamp}
      DEPENDS ${all_files} ${_tandem_modules_file}
      COMMENT "Checking the module layering (cmake/TandemModules.cmake)"
      VERBATIM)
    add_custom_target(tandem_module_check DEPENDS ${stamp})
  endif()
  set(TANDEM_MODULE_SOURCES ${all_sources} PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE AND DEFINED TANDEM_ROOT)
  tandem_check_modules(${TANDEM_ROOT})
endif()
