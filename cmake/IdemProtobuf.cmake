# SPDX-License-Identifier: MIT
# idem_grpc_generate(<target> PROTOS <file.proto>...): runs protoc with the grpc++ plugin on each
# file (imports resolved next to it), adds the generated .pb.cc / .grpc.pb.cc to <target>, its
# output directory to <target>'s PUBLIC include path, and links grpc++ and protobuf PUBLIC.
# Generated code is compiled without idem's warning flags.
function(idem_grpc_generate target)
  cmake_parse_arguments(G "" "" "PROTOS" ${ARGN})
  set(_out ${CMAKE_CURRENT_BINARY_DIR}/proto)
  file(MAKE_DIRECTORY ${_out})
  foreach(_proto IN LISTS G_PROTOS)
    get_filename_component(_abs ${_proto} ABSOLUTE)
    get_filename_component(_dir ${_abs} DIRECTORY)
    get_filename_component(_name ${_abs} NAME_WE)
    set(_generated ${_out}/${_name}.pb.cc ${_out}/${_name}.pb.h
                   ${_out}/${_name}.grpc.pb.cc ${_out}/${_name}.grpc.pb.h)
    add_custom_command(OUTPUT ${_generated}
      COMMAND protobuf::protoc --cpp_out=${_out} --grpc_out=${_out}
              --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin> -I${_dir} ${_abs}
      DEPENDS ${_abs}
      COMMENT "protoc ${_name}.proto"
      VERBATIM)
    target_sources(${target} PRIVATE ${_generated})
  endforeach()
  # SYSTEM: users of the generated headers compile them without their own warning flags.
  target_include_directories(${target} SYSTEM PUBLIC ${_out})
  target_link_libraries(${target} PUBLIC gRPC::grpc++ protobuf::libprotobuf)
endfunction()
