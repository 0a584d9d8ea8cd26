# SPDX-License-Identifier: MIT
# Warnings for idem's own targets (PRIVATE: never imposed on users), and optional sanitizers.
function(idem_enable_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
                           -Wnon-virtual-dtor -Wold-style-cast -Wcast-align
                           -Woverloaded-virtual)
    if(IDEM_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endif()
endfunction()

if(IDEM_SANITIZE)
  string(REPLACE ";" "," _idem_san "${IDEM_SANITIZE}")
  add_compile_options(-fsanitize=${_idem_san} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${_idem_san})
endif()
