# CMake's lists treat '[' and ']' as grouping, so a Catch test name holding an unmatched one
# makes catch_discover_tests register a run of tests as one (a name with "(0, 88]" hid 200
# of tandem-tests' 241 cases from ctest). Fails naming every test with a bracket.
# Usage: cmake -DEXE=tandem-tests -P check_test_names.cmake
execute_process(COMMAND "${EXE}" --list-test-names-only OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX MATCHALL "\n" lines "${out}")
list(LENGTH lines n)
if(n EQUAL 0)
  message(FATAL_ERROR "${EXE} --list-test-names-only listed no tests: ${err}")
endif()
string(REGEX MATCHALL "[^\n]*[][][^\n]*" bad "${out}")
if(bad)
  message(FATAL_ERROR "test names with '[' or ']' (catch_discover_tests cannot register them): ${bad}")
endif()
message(STATUS "${n} test names, none with '[' or ']'")
