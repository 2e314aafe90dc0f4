# Warning flags shared by every Tandem target. -Wno-missing-field-initializers: GCC 12 warns
# on C++20 designated initializers that leave members to their default initializers
# (`Options{.n_ctx = 512}`), which is what those defaults are for.
function(tandem_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion
                              -Wno-missing-field-initializers>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${TANDEM_WERROR}>>:-Werror>)
endfunction()
