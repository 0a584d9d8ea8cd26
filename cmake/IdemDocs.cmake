# SPDX-License-Identifier: MIT
# cmake -DDOXYGEN=<doxygen> -DDOXYFILE=<Doxyfile> -DLOG=<warnings.log> -P IdemDocs.cmake
# Runs Doxygen and fails when it warned: every warning is a public declaration without
# documentation (or with broken documentation), listed with its file and line, so whoever
# added it sees what to write (`///` before the declaration; see docs/Doxyfile.in).
# Doxygen writes its warnings to LOG only if LOG's directory exists (otherwise to stderr, where
# this check would not see them): make it, and treat a missing log as a failure.
get_filename_component(_dir ${LOG} DIRECTORY)
file(MAKE_DIRECTORY ${_dir})
file(REMOVE ${LOG})
execute_process(COMMAND ${DOXYGEN} ${DOXYFILE} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "docs: doxygen failed (${rc})")
endif()
if(NOT EXISTS ${LOG})
  message(FATAL_ERROR "docs: doxygen wrote no warnings log (${LOG}): cannot check")
endif()
file(STRINGS ${LOG} warnings)
list(LENGTH warnings n)
if(n GREATER 0)
  list(JOIN warnings "\n  " text)
  message(FATAL_ERROR "docs: ${n} Doxygen warning(s) on the public API: document each "
                      "declaration below with ///\n  ${text}")
endif()
get_filename_component(out ${LOG} DIRECTORY)
message(STATUS "docs: no Doxygen warning; ${out}/html/index.html")
