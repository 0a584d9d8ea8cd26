# SPDX-License-Identifier: MIT
# Install rules, pkg-config files and Debian packages of every component that is built, all
# made from cmake/IdemComponents.cmake (nothing here names a component but core and tools).
#
# Per built component <c> (its targets exist in this configuration):
#   lib/libidem_<c>.a (or .so)            install(TARGETS ... COMPONENT <c>)
#   lib/cmake/idem/idem-<c>-targets.cmake its exported targets (idem::<c>)
#   lib/pkgconfig/idem-<c>.pc             Requires: the components and libraries it needs
#   include/<its HEADERS>                 core gets include/idem minus the others' headers
#   idem-<c>_<version>_<arch>.deb         (cpack -G DEB) Depends: idem-<components>, DEB deps
# and, in core: idemConfig.cmake, idemConfigVersion.cmake, IdemComponents.cmake,
# IdemPackage.cmake, idem-installed.cmake (which components this install holds).
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(IDEM_CMAKE_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/idem)
set(IDEM_PKGCONFIG_INSTALL_DIR ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# Components whose targets all exist (their option is ON), in load order.
function(idem_built_components out)
  get_property(_all GLOBAL PROPERTY IDEM_COMPONENTS)
  set(_built "")
  foreach(_c IN LISTS _all)
    idem_component_get(_targets ${_c} TARGETS)
    set(_ok TRUE)
    foreach(_t IN LISTS _targets)
      if(NOT TARGET ${_t})
        set(_ok FALSE)
      endif()
    endforeach()
    if(_ok)
      list(APPEND _built ${_c})
    endif()
  endforeach()
  idem_component_closure(_ordered ${_built})
  set(${out} "${_ordered}" PARENT_SCOPE)
endfunction()

# A regular expression matching the include/ paths of `headers` (files or folders).
function(_idem_headers_regex out headers)
  set(_alts "")
  foreach(_h IN LISTS headers)
    string(REGEX REPLACE "([.+?*^$()|\\[\\]])" "\\\\\\1" _e "${_h}")
    # No groups: CMake's regular expressions allow ten at most (one per component would not fit).
    list(APPEND _alts "/${_e}/" "/${_e}$")
  endforeach()
  list(JOIN _alts "|" _re)
  set(${out} "${_re}" PARENT_SCOPE)
endfunction()

function(_idem_install_headers c)
  idem_component_get(_headers ${c} HEADERS)
  if(c STREQUAL "core")
    # Everything under include/idem that no other component claims.
    get_property(_all GLOBAL PROPERTY IDEM_COMPONENTS)
    set(_others "")
    foreach(_o IN LISTS _all)
      if(NOT _o STREQUAL "core")
        idem_component_get(_h ${_o} HEADERS)
        list(APPEND _others ${_h})
      endif()
    endforeach()
    _idem_headers_regex(_re "${_others}")
    install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/idem DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
            COMPONENT core REGEX "${_re}" EXCLUDE)
    return()
  endif()
  foreach(_h IN LISTS _headers)
    get_filename_component(_dir ${_h} DIRECTORY)
    if(IS_DIRECTORY ${PROJECT_SOURCE_DIR}/include/${_h})
      install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/${_h}
              DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${_dir} COMPONENT ${c})
    else()
      install(FILES ${PROJECT_SOURCE_DIR}/include/${_h}
              DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/${_dir} COMPONENT ${c})
    endif()
  endforeach()
endfunction()

# `cmake --install` after a build of some targets only (demo.sh, a quick start): builds the
# component's libraries first if their files are missing, instead of failing on them.
function(_idem_install_build_check c)
  idem_component_get(_targets ${c} TARGETS)
  set(_compiled "")
  foreach(_t IN LISTS _targets)
    get_target_property(_type ${_t} TYPE)
    if(NOT _type STREQUAL "INTERFACE_LIBRARY")
      list(APPEND _compiled ${_t})
    endif()
  endforeach()
  if(NOT _compiled)
    return()
  endif()
  set(_files "")
  foreach(_t IN LISTS _compiled)
    list(APPEND _files "$<TARGET_FILE:${_t}>")
  endforeach()
  install(CODE "
    set(_idem_missing FALSE)
    foreach(_idem_f IN ITEMS ${_files})
      if(NOT EXISTS \"\${_idem_f}\")
        set(_idem_missing TRUE)
      endif()
    endforeach()
    if(_idem_missing)
      message(STATUS \"idem: building ${_compiled} (not built yet) before installing them\")
      execute_process(COMMAND \"${CMAKE_COMMAND}\" --build \"${PROJECT_BINARY_DIR}\"
                              --config \"\${CMAKE_INSTALL_CONFIG_NAME}\" --target ${_compiled}
                      RESULT_VARIABLE _idem_rc)
      if(NOT _idem_rc EQUAL 0)
        message(FATAL_ERROR \"idem: building ${_compiled} failed\")
      endif()
    endif()" COMPONENT ${c})
endfunction()

function(_idem_write_pkgconfig c)
  idem_component_get(_targets ${c} TARGETS)
  idem_component_get(_needs ${c} COMPONENTS)
  idem_component_get(_public ${c} DEPENDS)
  idem_component_get(_private ${c} PRIVATE_DEPENDS)
  idem_component_get(_summary ${c} SUMMARY)
  set(_requires "")
  set(_requires_private "")
  foreach(_n IN LISTS _needs)
    list(APPEND _requires idem-${_n})
  endforeach()
  foreach(_d IN LISTS _public _private)
    idem_dependency_get(_pc ${_d} PKG_CONFIG)
    if(NOT _pc)
      continue()
    endif()
    # A static library's consumer links its private dependencies too: list them in Requires
    # so `pkg-config --libs` is enough; a shared one's only in Requires.private.
    if(_d IN_LIST _private AND BUILD_SHARED_LIBS)
      list(APPEND _requires_private ${_pc})
    else()
      list(APPEND _requires ${_pc})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _requires)
  list(JOIN _requires ", " _requires)
  list(JOIN _requires_private ", " _requires_private)
  set(_libs "")
  foreach(_t IN LISTS _targets)
    get_target_property(_type ${_t} TYPE)
    if(NOT _type STREQUAL "INTERFACE_LIBRARY")
      string(APPEND _libs " -l${_t}")
    endif()
  endforeach()
  if(_libs)
    set(_libs "-L\${libdir}${_libs}")
  endif()
  set(_cflags "")
  if(c STREQUAL "core")
    set(_cflags "-I\${includedir} -pthread")
    set(_libs "-pthread")
  endif()
  # Relocatable: the prefix is found from the .pc file's own place.
  if(IS_ABSOLUTE "${IDEM_PKGCONFIG_INSTALL_DIR}")
    set(_prefix "${CMAKE_INSTALL_PREFIX}")
  else()
    file(RELATIVE_PATH _up "/p/${IDEM_PKGCONFIG_INSTALL_DIR}" "/p")
    string(REGEX REPLACE "/$" "" _up "${_up}")
    set(_prefix "\${pcfiledir}/${_up}")
  endif()
  set(_pc "${PROJECT_BINARY_DIR}/pkgconfig/idem-${c}.pc")
  file(WRITE ${_pc}
    "prefix=${_prefix}\n"
    "libdir=\${prefix}/${CMAKE_INSTALL_LIBDIR}\n"
    "includedir=\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}\n\n"
    "Name: idem-${c}\n"
    "Description: idem ${_summary}\n"
    "Version: ${PROJECT_VERSION}\n")
  if(_requires)
    file(APPEND ${_pc} "Requires: ${_requires}\n")
  endif()
  if(_requires_private)
    file(APPEND ${_pc} "Requires.private: ${_requires_private}\n")
  endif()
  file(APPEND ${_pc} "Cflags: ${_cflags}\nLibs: ${_libs}\n")
  install(FILES ${_pc} DESTINATION ${IDEM_PKGCONFIG_INSTALL_DIR} COMPONENT ${c})
endfunction()

# Debian packages, one per component (cpack -G DEB): idem-<c>_<version>_<arch>.deb.
macro(_idem_cpack components)
  set(CPACK_PACKAGE_NAME idem)
  set(CPACK_PACKAGE_VENDOR "The idem authors")
  set(CPACK_PACKAGE_CONTACT "The idem authors")
  set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
  set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "${PROJECT_DESCRIPTION}")
  set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)
  set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
  set(CPACK_DEB_COMPONENT_INSTALL ON)
  set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
  set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
  set(CPACK_DEBIAN_PACKAGE_SECTION libdevel)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
  set(CPACK_COMPONENTS_ALL ${components})
  foreach(_idem_c IN ITEMS ${components})
    string(TOUPPER ${_idem_c} _idem_C)
    if(_idem_c STREQUAL "tools")
      set(CPACK_COMPONENT_TOOLS_DESCRIPTION "idem operator tools (idemctl)")
      set(CPACK_DEBIAN_TOOLS_PACKAGE_SECTION admin)
      continue()
    endif()
    idem_component_get(_idem_summary ${_idem_c} SUMMARY)
    idem_component_get(_idem_needs ${_idem_c} COMPONENTS)
    idem_component_get(_idem_public ${_idem_c} DEPENDS)
    idem_component_get(_idem_private ${_idem_c} PRIVATE_DEPENDS)
    set(CPACK_COMPONENT_${_idem_C}_DESCRIPTION "idem: ${_idem_summary}")
    set(CPACK_COMPONENT_${_idem_C}_DEPENDS ${_idem_needs})
    set(_idem_debs "")
    foreach(_idem_d IN LISTS _idem_public _idem_private)
      idem_dependency_get(_idem_deb ${_idem_d} DEB)
      if(_idem_deb)
        list(APPEND _idem_debs ${_idem_deb})
      endif()
      # Found through pkg-config on Debian (its -dev packages do not depend on it).
      idem_dependency_get(_idem_ways ${_idem_d} FIND)
      if(_idem_ways MATCHES "PKG_CONFIG")
        list(APPEND _idem_debs pkg-config)
      endif()
    endforeach()
    list(REMOVE_DUPLICATES _idem_debs)
    list(JOIN _idem_debs ", " _idem_debs)
    set(CPACK_DEBIAN_${_idem_C}_PACKAGE_DEPENDS "${_idem_debs}")
  endforeach()
  include(CPack)
endmacro()

# Properties of every compiled library of a built component, install or not: hidden symbol
# visibility (include/idem/export.hpp: a shared build exports what is marked IDEM_EXPORT only)
# and, for shared builds, the SONAME (docs/versioning.md): .so.MAJOR.MINOR while MAJOR is 0,
# then .so.MAJOR. Call once, after all targets exist.
function(idem_library_properties)
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(_soversion ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
  else()
    set(_soversion ${PROJECT_VERSION_MAJOR})
  endif()
  idem_built_components(_built)
  foreach(_c IN LISTS _built)
    idem_component_get(_targets ${_c} TARGETS)
    foreach(_t IN LISTS _targets)
      get_target_property(_type ${_t} TYPE)
      if(NOT _type STREQUAL "INTERFACE_LIBRARY")
        # $ORIGIN: an installed libidem_async_redis.so finds the libidem_redis.so next to it, wherever
        # the prefix is.
        set_target_properties(${_t} PROPERTIES CXX_VISIBILITY_PRESET hidden
                              VERSION ${PROJECT_VERSION} SOVERSION ${_soversion}
                              INSTALL_RPATH "$ORIGIN")
      endif()
    endforeach()
  endforeach()
endfunction()

# Every install rule of the package. Call once, after all targets exist.
macro(idem_install_package)
  idem_built_components(_idem_built)
  foreach(_idem_c IN LISTS _idem_built)
    idem_component_get(_idem_targets ${_idem_c} TARGETS)
    _idem_install_build_check(${_idem_c})
    install(TARGETS ${_idem_targets} EXPORT idem-${_idem_c}-targets COMPONENT ${_idem_c}
            ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
            LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
            RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    install(EXPORT idem-${_idem_c}-targets NAMESPACE idem:: DESTINATION ${IDEM_CMAKE_INSTALL_DIR}
            COMPONENT ${_idem_c})
    _idem_install_headers(${_idem_c})
    _idem_write_pkgconfig(${_idem_c})
  endforeach()

  # The package files. Version rule (docs/versioning.md): while the major version is 0, only
  # the same major.minor satisfies a request (0.2 may break 0.1's API); from 1.0 on, the same
  # major version.
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(_idem_compat SameMinorVersion)
  else()
    set(_idem_compat SameMajorVersion)
  endif()
  set(IDEM_INSTALLED_COMPONENTS "${_idem_built}")
  # The target each dependency was found as (dependency=target): the exported targets link
  # those names, so the installed config provides them whichever way it finds the library.
  set(IDEM_BUILT_DEPENDENCY_TARGETS "")
  foreach(_idem_c IN LISTS _idem_built)
    idem_component_get(_idem_ds ${_idem_c} DEPENDS)
    idem_component_get(_idem_ps ${_idem_c} PRIVATE_DEPENDS)
    foreach(_idem_d IN LISTS _idem_ds _idem_ps)
      string(TOUPPER "${_idem_d}" _idem_v)
      string(REPLACE "-" "_" _idem_v "${_idem_v}")
      if(IDEM_${_idem_v}_TARGET)
        list(APPEND IDEM_BUILT_DEPENDENCY_TARGETS "${_idem_d}=${IDEM_${_idem_v}_TARGET}")
      endif()
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES IDEM_BUILT_DEPENDENCY_TARGETS)
  set(IDEM_SHARED_BUILD OFF)
  if(BUILD_SHARED_LIBS)
    set(IDEM_SHARED_BUILD ON)
  endif()
  configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/idemConfig.cmake.in
    ${PROJECT_BINARY_DIR}/idemConfig.cmake INSTALL_DESTINATION ${IDEM_CMAKE_INSTALL_DIR})
  write_basic_package_version_file(${PROJECT_BINARY_DIR}/idemConfigVersion.cmake
    COMPATIBILITY ${_idem_compat})
  install(FILES ${PROJECT_BINARY_DIR}/idemConfig.cmake
                ${PROJECT_BINARY_DIR}/idemConfigVersion.cmake
                ${PROJECT_SOURCE_DIR}/cmake/IdemComponents.cmake
                ${PROJECT_SOURCE_DIR}/cmake/IdemPackage.cmake
          DESTINATION ${IDEM_CMAKE_INSTALL_DIR} COMPONENT core)
  install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/CHANGELOG.md
          DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT core)

  set(_idem_packaged ${_idem_built})
  if(TARGET idemctl)
    list(APPEND _idem_packaged tools)
  endif()
  _idem_cpack("${_idem_packaged}")
endmacro()
