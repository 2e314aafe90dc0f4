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
set(c_out "${out}")

# The ```cpp block of README.md that begins with "// app.cpp", as written.
string(FIND "${readme}" "\n```cpp\n// app.cpp" start)
if(start EQUAL -1)
  fail("README.md has no ```cpp block starting with // app.cpp")
endif()
math(EXPR start "${start} + 8")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "\n```" stop)
string(SUBSTRING "${rest}" 0 ${stop} program)
file(WRITE "${work}/app.cpp" "${program}\n")
execute_process(COMMAND "${CXX}" -std=c++17 -Wall -Wextra -Wpedantic -Werror ${sanitize_flags} "${work}/app.cpp"
                        -I "${prefix}/include" -L "${prefix}/lib" -ltandem "-Wl,-rpath,${prefix}/lib"
                        -o "${work}/app-cpp"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  fail("README.md's C++ program does not compile against the install:\n${out}${err}")
endif()
execute_process(COMMAND "${work}/app-cpp" "${MODEL}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "\\[[0-9]+ tokens, finish reason [0-9]\\]\n.*\\[request [0-9]+: [0-9]+ tokens\\]")
  fail("README.md's C++ program: rc ${rc}, stdout '${out}', stderr '${err}'")
endif()

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
