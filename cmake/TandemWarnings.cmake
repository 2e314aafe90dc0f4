# Warning flags shared by every Tandem target.
function(tandem_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${TANDEM_WERROR}>>:-Werror>)
endfunction()
