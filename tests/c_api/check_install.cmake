# `cmake --install` into a fresh prefix, then: the tools are in bin/ (tandem-server too when
# it was built: docs/deploy.md runs it), and README.md's C program compiles as C99 with
# warnings as errors against the installed tandem.h and libtandem.so, runs, and streams text.
# Usage: cmake -DBUILD=dir -DSOURCE=dir -DCC=compiler [-DSANITIZE=address,undefined] -DSERVER=0|1 -DMODEL=gguf
#        -P check_install.cmake
string(RANDOM LENGTH 10 tag)
set(work "${BUILD}/install-check-${tag}")
set(prefix "${work}/prefix")
file(MAKE_DIRECTORY "${work}")
function(fail msg)
  file(REMOVE_RECURSE "${work}")
  message(FATAL_ERROR "${msg}")
endfunction()

execute_process(COMMAND ${CMAKE_COMMAND} --install "${BUILD}" --prefix "${prefix}" RESULT_VARIABLE rc
                OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  fail("cmake --install failed: ${err}")
endif()
set(tools tandem-cli tandem-bench tandem-synth tandem-quantize)
if(SERVER)
  list(APPEND tools tandem-server)
endif()
foreach(t IN LISTS tools)
  if(NOT EXISTS "${prefix}/bin/${t}")
    fail("cmake --install did not install bin/${t}")
  endif()
endforeach()

# The one ```c block of README.md, as written.
file(READ "${SOURCE}/README.md" readme)
string(FIND "${readme}" "\n```c\n" start)
if(start EQUAL -1)
  fail("README.md has no ```c block")
endif()
math(EXPR start "${start} + 6")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "\n```" stop)
string(SUBSTRING "${rest}" 0 ${stop} program)
file(WRITE "${work}/app.c" "${program}\n")
set(sanitize_flags "")
if(SANITIZE)
  set(sanitize_flags "-fsanitize=${SANITIZE}")
endif()
execute_process(COMMAND "${CC}" -std=c99 -Wall -Wextra -Wpedantic -Werror -pedantic-errors ${sanitize_flags} "${work}/app.c"
                        -I "${prefix}/include" -L "${prefix}/lib" -ltandem "-Wl,-rpath,${prefix}/lib"
                        -o "${work}/app"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  fail("README.md's C program does not compile against the install:\n${out}${err}")
endif()
execute_process(COMMAND "${work}/app" "${MODEL}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "\\[64 tokens, finish reason 2\\]")
  fail("README.md's C program: rc ${rc}, stdout '${out}', stderr '${err}'")
endif()
string(FIND "${out}" "\n[64 tokens" text_end)
if(text_end LESS 10)
  fail("README.md's C program streamed no text: '${out}'")
endif()
file(REMOVE_RECURSE "${work}")
message(STATUS "install ok (${tools}); README.md's C program: ${out}")
