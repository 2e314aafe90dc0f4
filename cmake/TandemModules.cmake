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
#   exec       executor interface, paced executor, performance model; exec/cpu, exec/gpu
#   node       executor sets, executors and their KV stores sized by one page rule
#   session    session, session files, chat session, generation, sampler, stop strings
#   sched      scheduler, routing policy, speed signals, metrics, request handles
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

# Fails configuration for an include across modules that the including module does not
# declare above, and for a library file outside every module. Sets TANDEM_MODULE_SOURCES.
function(tandem_check_modules root)
  set(all_sources "")
  foreach(mod IN LISTS TANDEM_MODULES)
    file(GLOB files CONFIGURE_DEPENDS ${root}/lib/${mod}/*.cpp ${root}/lib/${mod}/*.hpp
         ${root}/include/tandem/${mod}/*.hpp)
    set(allowed ${mod} ${TANDEM_MODULE_DEPS_${mod}})
    foreach(f IN LISTS files)
      if(f MATCHES "\\.cpp$")
        list(APPEND all_sources ${f})
      endif()
      file(STRINGS ${f} includes REGEX "^#include \"")
      foreach(line IN LISTS includes)
        # "tandem/<module>/x.hpp" (public) or "<module>/x.hpp" (private, from lib/)
        if(line MATCHES "^#include \"(tandem/)?([a-z_]+(/cpu|/gpu)?)/[a-z0-9_]+\\.hpp\"")
          set(target ${CMAKE_MATCH_2})
          if(target IN_LIST TANDEM_MODULES AND NOT target IN_LIST allowed)
            file(RELATIVE_PATH rel ${root} ${f})
            message(FATAL_ERROR "${rel} (module ${mod}) includes ${target}/, which module ${mod} does not "
                                "declare (cmake/TandemModules.cmake: TANDEM_MODULE_DEPS_${mod})")
          endif()
        endif()
      endforeach()
    endforeach()
  endforeach()
  file(GLOB_RECURSE every CONFIGURE_DEPENDS ${root}/lib/*.cpp)
  foreach(f IN LISTS every)
    if(NOT f IN_LIST all_sources)
      file(RELATIVE_PATH rel ${root} ${f})
      message(FATAL_ERROR "${rel} is in no module of cmake/TandemModules.cmake")
    endif()
  endforeach()
  set(TANDEM_MODULE_SOURCES ${all_sources} PARENT_SCOPE)
endfunction()
