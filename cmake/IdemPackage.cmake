# SPDX-License-Identifier: MIT
# The functions behind cmake/IdemComponents.cmake: they record what each component needs and
# find it. Used by idem's own build (cmake/IdemDependencies.cmake) and, installed, by
# idemConfig.cmake, so a consumer finds exactly the dependencies of the components it asks for.
include_guard(GLOBAL)
# The functions keep these policies wherever they are called from (a consumer's project may
# declare an older cmake_minimum_required).
cmake_policy(PUSH)
cmake_policy(VERSION 3.21...3.25)

# idem_dependency(<name> FIND <way>... [PKG_CONFIG <module>] [DEB <package>])
#
# A third-party library one or more components link. Finding it sets IDEM_<NAME>_TARGET (upper
# case) to the imported target that was found. Each FIND <way> is tried in order until one
# gives a target:
#   "CONFIG <Package> <target>"                    find_package(<Package> CONFIG QUIET)
#   "MODULE <Package> <target> [<component>...]"   find_package(<Package> QUIET COMPONENTS ...)
#   "PKG_CONFIG <module>"                          pkg_check_modules(IMPORTED_TARGET <module>):
#                                                  PkgConfig::<module>
# PKG_CONFIG names the module that idem's own .pc files list in Requires; DEB the Debian
# package that provides the library and its headers (the .deb of each component depends on
# it, and error messages tell users to install it).
function(idem_dependency name)
  cmake_parse_arguments(D "" "PKG_CONFIG;DEB" "FIND" ${ARGN})
  if(NOT D_FIND)
    message(FATAL_ERROR "idem_dependency(${name}): no FIND way given")
  endif()
  set_property(GLOBAL PROPERTY IDEM_DEP_${name}_FIND "${D_FIND}")
  set_property(GLOBAL PROPERTY IDEM_DEP_${name}_PKG_CONFIG "${D_PKG_CONFIG}")
  set_property(GLOBAL PROPERTY IDEM_DEP_${name}_DEB "${D_DEB}")
endfunction()

# idem_component(<name> TARGETS <target>... [OPTION <IDEM_WITH_...>] [COMPONENTS <component>...]
#                [DEPENDS <dependency>...] [PRIVATE_DEPENDS <dependency>...]
#                [HEADERS <path under include/>...] [SUMMARY <text>])
#
# A component of the package: `find_package(idem COMPONENTS <name>)` makes its TARGETS
# (idem::<EXPORT_NAME>) available. COMPONENTS are other idem components it needs (loaded
# first). DEPENDS are idem_dependency() names its targets link PUBLIC or INTERFACE (always
# needed by a consumer); PRIVATE_DEPENDS those linked PRIVATE (needed by a consumer of a
# static build only, to link). OPTION is the build option that builds it (none: always built).
# HEADERS are the public headers (files or folders, relative to include/) that belong to it
# rather than to core; SUMMARY is the one-line description of its .pc file and .deb.
function(idem_component name)
  cmake_parse_arguments(C "" "OPTION;SUMMARY"
                        "TARGETS;COMPONENTS;DEPENDS;PRIVATE_DEPENDS;HEADERS" ${ARGN})
  if(NOT C_TARGETS)
    message(FATAL_ERROR "idem_component(${name}): no TARGETS given")
  endif()
  set_property(GLOBAL APPEND PROPERTY IDEM_COMPONENTS ${name})
  foreach(_f TARGETS COMPONENTS DEPENDS PRIVATE_DEPENDS HEADERS OPTION SUMMARY)
    set_property(GLOBAL PROPERTY IDEM_COMPONENT_${name}_${_f} "${C_${_f}}")
  endforeach()
endfunction()

# idem_component_get(<out-var> <component> <field>): a field recorded by idem_component().
function(idem_component_get out name field)
  get_property(_v GLOBAL PROPERTY IDEM_COMPONENT_${name}_${field})
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

# idem_dependency_get(<out-var> <dependency> <field>): FIND, PKG_CONFIG or DEB.
function(idem_dependency_get out name field)
  get_property(_v GLOBAL PROPERTY IDEM_DEP_${name}_${field})
  set(${out} "${_v}" PARENT_SCOPE)
endfunction()

# idem_component_closure(<out-var> <component>...): the components and every component they
# need, each listed after what it needs (the order to load them in).
function(idem_component_closure out)
  set(_done "")
  set(_stack ${ARGN})
  # Depth-first with an explicit post-order: a component goes out once its needs are out.
  foreach(_round RANGE 64)
    if(NOT _stack)
      break()
    endif()
    list(GET _stack 0 _c)
    if(_c IN_LIST _done)
      list(REMOVE_AT _stack 0)
      continue()
    endif()
    get_property(_known GLOBAL PROPERTY IDEM_COMPONENT_${_c}_TARGETS SET)
    if(NOT _known)
      message(FATAL_ERROR "idem: unknown component '${_c}'")
    endif()
    get_property(_needs GLOBAL PROPERTY IDEM_COMPONENT_${_c}_COMPONENTS)
    set(_pending "")
    foreach(_n IN LISTS _needs)
      if(NOT _n IN_LIST _done)
        list(APPEND _pending ${_n})
      endif()
    endforeach()
    if(_pending)
      list(PREPEND _stack ${_pending})
    else()
      list(APPEND _done ${_c})
      list(REMOVE_AT _stack 0)
    endif()
  endforeach()
  set(${out} "${_done}" PARENT_SCOPE)
endfunction()

# idem_component_dependencies(<out-var> <component> [WITH_PRIVATE]): the idem_dependency()
# names a consumer of <component> needs (its own and those of the components it needs).
function(idem_component_dependencies out name)
  idem_component_closure(_comps ${name})
  set(_deps "")
  foreach(_c IN LISTS _comps)
    get_property(_d GLOBAL PROPERTY IDEM_COMPONENT_${_c}_DEPENDS)
    list(APPEND _deps ${_d})
    if("WITH_PRIVATE" IN_LIST ARGN)
      get_property(_p GLOBAL PROPERTY IDEM_COMPONENT_${_c}_PRIVATE_DEPENDS)
      list(APPEND _deps ${_p})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _deps)
  set(${out} "${_deps}" PARENT_SCOPE)
endfunction()

# idem_find_dependency(<dependency>): tries its FIND ways; on success sets IDEM_<NAME>_TARGET
# in the caller's scope, else leaves it unset. Already found (the variable is set and names a
# target): nothing to do.
macro(idem_find_dependency _idem_dep)
  string(TOUPPER "${_idem_dep}" _idem_up)
  string(REPLACE "-" "_" _idem_up "${_idem_up}")
  if(NOT (DEFINED IDEM_${_idem_up}_TARGET AND TARGET "${IDEM_${_idem_up}_TARGET}"))
    unset(IDEM_${_idem_up}_TARGET)
    get_property(_idem_ways GLOBAL PROPERTY IDEM_DEP_${_idem_dep}_FIND)
    if(NOT _idem_ways)
      message(FATAL_ERROR "idem: no idem_dependency(${_idem_dep}) declared")
    endif()
    foreach(_idem_way IN LISTS _idem_ways)
      separate_arguments(_idem_w UNIX_COMMAND "${_idem_way}")
      list(POP_FRONT _idem_w _idem_kind)
      if(_idem_kind STREQUAL "PKG_CONFIG")
        list(GET _idem_w 0 _idem_mod)
        if(NOT TARGET PkgConfig::${_idem_mod})
          find_package(PkgConfig QUIET)
          if(PkgConfig_FOUND)
            pkg_check_modules(${_idem_mod} QUIET IMPORTED_TARGET ${_idem_mod})
          endif()
        endif()
        set(_idem_tgt PkgConfig::${_idem_mod})
      elseif(_idem_kind STREQUAL "CONFIG" OR _idem_kind STREQUAL "MODULE")
        list(POP_FRONT _idem_w _idem_pkg _idem_tgt)
        if(NOT TARGET ${_idem_tgt})
          if(_idem_kind STREQUAL "CONFIG")
            find_package(${_idem_pkg} CONFIG QUIET)
          elseif(_idem_w)
            find_package(${_idem_pkg} QUIET COMPONENTS ${_idem_w})
          else()
            find_package(${_idem_pkg} QUIET)
          endif()
        endif()
      else()
        message(FATAL_ERROR "idem_dependency(${_idem_dep}): unknown way '${_idem_way}'")
      endif()
      if(TARGET ${_idem_tgt})
        set(IDEM_${_idem_up}_TARGET ${_idem_tgt})
        break()
      endif()
    endforeach()
  endif()
endmacro()

# idem_dependency_hint(<out-var> <dependency>): "apt-get install <deb>" or the ways tried.
function(idem_dependency_hint out name)
  get_property(_deb GLOBAL PROPERTY IDEM_DEP_${name}_DEB)
  get_property(_ways GLOBAL PROPERTY IDEM_DEP_${name}_FIND)
  # No ';' in the text: it travels in lists.
  string(REPLACE ";" " | " _ways "${_ways}")
  if(_deb AND _ways MATCHES "PKG_CONFIG")
    set(${out} "${name} not found (apt-get install ${_deb} pkg-config) - tried: ${_ways}"
        PARENT_SCOPE)
  elseif(_deb)
    set(${out} "${name} not found (apt-get install ${_deb}) - tried: ${_ways}" PARENT_SCOPE)
  else()
    set(${out} "${name} not found - tried: ${_ways}" PARENT_SCOPE)
  endif()
endfunction()

cmake_policy(POP)
