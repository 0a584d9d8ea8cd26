# SPDX-License-Identifier: MIT
# Finds what the components being built link (the list and each dependency's ways to be found:
# cmake/IdemComponents.cmake). A component is built when it has no OPTION or its OPTION is ON;
# a missing dependency of one stops the configuration with the Debian package to install and
# the option that turns the component off. Sets IDEM_<DEPENDENCY>_TARGET for each (e.g.
# IDEM_HIREDIS_TARGET, IDEM_PQXX_TARGET, IDEM_HTTPLIB_TARGET).
include(${CMAKE_CURRENT_LIST_DIR}/IdemComponents.cmake)

set(THREADS_PREFER_PTHREAD_FLAG ON)
get_property(_idem_all_components GLOBAL PROPERTY IDEM_COMPONENTS)
foreach(_idem_c IN LISTS _idem_all_components)
  idem_component_get(_idem_opt ${_idem_c} OPTION)
  if(_idem_opt AND NOT ${_idem_opt})
    continue()
  endif()
  idem_component_dependencies(_idem_deps ${_idem_c} WITH_PRIVATE)
  foreach(_idem_d IN LISTS _idem_deps)
    idem_find_dependency(${_idem_d})
    string(TOUPPER "${_idem_d}" _idem_v)
    string(REPLACE "-" "_" _idem_v "${_idem_v}")
    if(NOT IDEM_${_idem_v}_TARGET)
      idem_dependency_hint(_idem_hint ${_idem_d})
      if(_idem_opt)
        message(FATAL_ERROR "idem: ${_idem_hint}\n  or configure with -D${_idem_opt}=OFF")
      else()
        message(FATAL_ERROR "idem: ${_idem_hint}")
      endif()
    endif()
  endforeach()
endforeach()

# The core calls libcrypto 3 functions (EVP_MD_fetch; idem/detail/libcrypto.hpp declares them
# without OpenSSL's headers): OpenSSL 1.1 would fail at link time, so say it here.
if(OPENSSL_VERSION AND OPENSSL_VERSION VERSION_LESS 3.0)
  message(FATAL_ERROR "idem: OpenSSL ${OPENSSL_VERSION} found; idem needs OpenSSL >= 3.0 "
                      "(Debian 12: apt-get install libssl-dev)")
endif()
