# `cmake --install` into a fresh prefix, then: the tools are in bin/ (tandem-server too when
# it was built: docs/deploy.md runs it); README.md's C program compiles as C99 with warnings
# as errors against the installed tandem.h and libtandem.so, runs, and streams text;
# README.md's C++ program (the ```cpp block starting "// app.cpp") compiles as C++17 against
# the installed tandem.hpp and runs; and examples/samples/cpp, configured with
# find_package(Tandem) against the prefix, builds and passes its checks.
# Usage: cmake -DBUILD=dir -DSOURCE=dir -DCC=compiler -DCXX=compiler -DGENERATOR=name
#        [-DSANITIZE=address,undefined] -DSERVER=0|1 -DMODEL=gguf -P check_install.cmake
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

file(READ "${SOURCE}/README.md" readme)
set(sanitize_flags "")
if(SANITIZE)
  set(sanitize_flags "-fsanitize=${SANITIZE}")
endif()

# The README.md block opened by the line `fence` whose text begins with `first_line`, as
# written, into ${work}/${file}.
function(readme_block fence first_line file)
  string(FIND "${readme}" "\n${fence}\n${first_line}" start)
  if(start EQUAL -1)
    fail("README.md has no ${fence} block starting with '${first_line}'")
  endif()
  string(LENGTH "\n${fence}\n" fence_length)
  math(EXPR start "${start} + ${fence_length}")
  string(SUBSTRING "${readme}" ${start} -1 rest)
  string(FIND "${rest}" "\n```" stop)
  string(SUBSTRING "${rest}" 0 ${stop} program)
  file(WRITE "${work}/${file}" "${program}\n")
endfunction()

# Compiles ${work}/${source} with `compiler` and the flags after the named arguments
# against the install, runs it on the model, and checks that it exits 0 with stdout
# matching `regex`; the stdout in ${out_var}.
function(build_and_run what compiler source regex out_var)
  execute_process(COMMAND "${compiler}" ${ARGN} ${sanitize_flags} "${work}/${source}" -I "${prefix}/include"
                          -L "${prefix}/lib" -ltandem "-Wl,-rpath,${prefix}/lib" -o "${work}/${source}.bin"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    fail("${what} does not compile against the install:\n${out}${err}")
  endif()
  execute_process(COMMAND "${work}/${source}.bin" "${MODEL}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "${regex}")
    fail("${what}: rc ${rc}, stdout '${out}', stderr '${err}'")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# The one ```c block of README.md, as C99 with warnings as errors; it streams text.
readme_block("```c" "" app.c)
build_and_run("README.md's C program" "${CC}" app.c "\\[64 tokens, finish reason 2\\]" c_out -std=c99 -Wall
              -Wextra -Wpedantic -Werror -pedantic-errors)
string(FIND "${c_out}" "\n[64 tokens" text_end)
if(text_end LESS 10)
  fail("README.md's C program streamed no text: '${c_out}'")
endif()

# The ```cpp block of README.md that begins with "// app.cpp", as C++17.
readme_block("```cpp" "// app.cpp" app.cpp)
build_and_run("README.md's C++ program" "${CXX}" app.cpp
              "\\[[0-9]+ tokens, finish reason [0-9]\\]\n.*\\[request [0-9]+: [0-9]+ tokens\\]" cpp_out -std=c++17
              -Wall -Wextra -Wpedantic -Werror)

# examples/samples/cpp: an outside CMake project on find_package(Tandem).
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE}/examples/samples/cpp" -B "${work}/cpp" -G "${GENERATOR}"
                        "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX}"
                        "-DCMAKE_CXX_FLAGS=${sanitize_flags}" "-DCMAKE_EXE_LINKER_FLAGS=${sanitize_flags}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  execute_process(COMMAND ${CMAKE_COMMAND} --build "${work}/cpp" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
endif()
if(NOT rc EQUAL 0)
  fail("examples/samples/cpp does not build against the install:\n${out}${err}")
endif()
execute_process(COMMAND "${work}/cpp/tandem-sample-cpp" "${MODEL}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  fail("examples/samples/cpp: rc ${rc}, stdout '${out}', stderr '${err}'")
endif()
file(REMOVE_RECURSE "${work}")
message(STATUS "install ok (${tools}); README.md's C program: ${c_out}; examples/samples/cpp: ${err}${out}")
