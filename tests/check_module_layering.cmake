# ctest module_layering: cmake/TandemModules.cmake, run as the build-time check runs it, on
# small trees written here. Each spelling of an include of sched/ from core/ is refused with
# the module named; an include the module declares passes; a file outside every module is
# refused.   cmake -DSOURCE=<repo> -DWORK=<scratch dir> -P tests/check_module_layering.cmake
cmake_minimum_required(VERSION 3.24)

function(run_check root out_rc out_err)
  execute_process(COMMAND ${CMAKE_COMMAND} -DTANDEM_ROOT=${root} -P ${SOURCE}/cmake/TandemModules.cmake
                  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
  set(${out_rc} ${rc} PARENT_SCOPE)
  set(${out_err} "${err}" PARENT_SCOPE)
endfunction()

set(refused_0 "#include \"tandem/sched/scheduler.hpp\"")
set(refused_1 "  #include \"tandem/sched/scheduler.hpp\"")
set(refused_2 "#include <tandem/sched/scheduler.hpp>")
set(refused_3 "#include \"../../include/tandem/sched/scheduler.hpp\"")
set(refused_4 "# include \"../sched/scheduler_internal.hpp\"")
set(refused_5 "#include <sched/speed_signals.hpp>")
set(refused_6 "#include \"tandem/sched//scheduler.hpp\"")
set(refused_7 "#include \"sched/./speed_signals.hpp\"")
set(refused_8 "#include \"core/../sched/speed_signals.hpp\"")
set(refused_9 "#include \"../../lib/sched/speed_signals.hpp\"")
set(refused_10 "#include \"tandem/exec/cpu/../../sched/scheduler.hpp\"")
set(refused_11 "#include /* c */ \"tandem/sched/scheduler.hpp\"")
foreach(i RANGE 11)
  set(root ${WORK}/refused_${i})
  file(REMOVE_RECURSE ${root})
  file(WRITE ${root}/lib/core/a.cpp "${refused_${i}}\n")
  run_check(${root} rc err)
  if(rc EQUAL 0 OR NOT err MATCHES "lib/core/a.cpp \\(module core\\) includes sched/, which module core does not")
    message(FATAL_ERROR "not refused: '${refused_${i}}' in lib/core (rc ${rc}): ${err}")
  endif()
endforeach()

set(root ${WORK}/allowed)
file(REMOVE_RECURSE ${root})
file(WRITE ${root}/lib/sched/a.cpp
     "#include \"tandem/core/error.hpp\"\n#include <tandem/kv/kv_store.hpp>\n#include <fmt/format.h>\n"
     "#include \"../session/x.hpp\"\n#include <string>\n")
run_check(${root} rc err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "a declared include was refused (rc ${rc}): ${err}")
endif()

set(root ${WORK}/outside)
file(REMOVE_RECURSE ${root})
file(WRITE ${root}/lib/nomodule/a.cpp "int x;\n")
run_check(${root} rc err)
if(rc EQUAL 0 OR NOT err MATCHES "lib/nomodule/a.cpp is in no module")
  message(FATAL_ERROR "a file outside every module was not refused (rc ${rc}): ${err}")
endif()
message(STATUS "module layering: 12 spellings refused, a declared include passes, a stray file refused")
