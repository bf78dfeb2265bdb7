# cmake/MoeInstall.cmake - install rules: `cmake --install build --prefix P`.
#
#   P/bin/moe-lua                          the host (RPATH $ORIGIN/../lib)
#   P/lib/libmoe_core.so                   the core (CPU, CUDA kernels when built)
#   P/lib/lua/5.4/moe.so                   the Lua C module for stock lua5.4
#   P/share/lua/5.4/moe/...                the Lua library (lua/ of the source)
#   P/include/moe/moe.h, moe_*.h           the public C headers
#   P/lib/pkgconfig/moe.pc                 pkg-config (relocatable: ${pcfiledir})
#   P/share/moe-lua/experiments/*.lua      the runnable scripts
#
# The Lua folders are LuaRocks' and Debian's layout (LUA_PATH / LUA_CPATH of
# a tree P): with P = /usr/local, stock lua5.4 finds both without settings.
# Every run-time path is relative: the host's RPATH and its Lua folders
# (bindings/host.c, setup_path) are taken from the executable's location, the
# module's RPATH from its own, so the prefix can be moved or copied whole.
#
# MOE_LUAROCKS=ON (set by the rockspec) installs for LuaRocks' deploy step,
# which moves <LIBDIR>/* to <tree>/lib/lua/5.4, <LUADIR>/* to
# <tree>/share/lua/5.4 and <BINDIR>/* to <tree>/bin: libmoe_core.so goes
# beside moe.so (RPATH $ORIGIN), the host's RPATH is $ORIGIN/../lib/lua/5.4,
# and no headers or moe.pc are installed (their paths would not survive it).

include(GNUInstallDirs)

set(MOE_LUA_VERSION "${LUA_VERSION}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" MOE_LUA_VERSION "${MOE_LUA_VERSION}")
if(NOT MOE_LUA_VERSION)
  set(MOE_LUA_VERSION 5.4)
endif()
set(MOE_INSTALL_LUADIR "share/lua/${MOE_LUA_VERSION}" CACHE STRING
    "Where the Lua library (lua/) is installed, relative to the prefix or absolute")
set(MOE_INSTALL_LUA_CDIR "lib/lua/${MOE_LUA_VERSION}" CACHE STRING
    "Where the Lua C module moe.so is installed, relative to the prefix or absolute")
option(MOE_LUAROCKS "Install for LuaRocks' deploy layout (set by the rockspec)" OFF)

# The path from install dir `from` to install dir `to`. Two relative dirs
# are taken under a stand-in prefix, so the answer holds for whatever prefix
# `cmake --install --prefix` gets; an absolute one fixes CMAKE_INSTALL_PREFIX.
function(moe_install_rel out from to)
  set(root "/moe-install-prefix")
  if(IS_ABSOLUTE "${from}" OR IS_ABSOLUTE "${to}")
    set(root "${CMAKE_INSTALL_PREFIX}")
  endif()
  foreach(v from to)
    if(NOT IS_ABSOLUTE "${${v}}")
      string(REGEX REPLACE "/+$" "" ${v} "${root}/${${v}}")
    endif()
  endforeach()
  file(RELATIVE_PATH r "${from}" "${to}")
  string(REGEX REPLACE "/+$" "" r "${r}")
  if(r STREQUAL "")
    set(r ".")
  endif()
  set(${out} "${r}" PARENT_SCOPE)
endfunction()

if(MOE_LUAROCKS)
  set(moe_core_dest "${MOE_INSTALL_LUA_CDIR}")
  set(moe_host_lib_rel "../lib/lua/${MOE_LUA_VERSION}")
  set(moe_host_lua_rel "../share/lua/${MOE_LUA_VERSION}")
  set(moe_host_clua_rel "../lib/lua/${MOE_LUA_VERSION}")
  set(moe_module_lib_rel ".")
else()
  set(moe_core_dest "${CMAKE_INSTALL_LIBDIR}")
  moe_install_rel(moe_host_lib_rel "${CMAKE_INSTALL_BINDIR}" "${CMAKE_INSTALL_LIBDIR}")
  moe_install_rel(moe_host_lua_rel "${CMAKE_INSTALL_BINDIR}" "${MOE_INSTALL_LUADIR}")
  moe_install_rel(moe_host_clua_rel "${CMAKE_INSTALL_BINDIR}" "${MOE_INSTALL_LUA_CDIR}")
  moe_install_rel(moe_module_lib_rel "${MOE_INSTALL_LUA_CDIR}" "${CMAKE_INSTALL_LIBDIR}")
endif()

# The host looks for its Lua folders relative to its executable (setup_path).
set_property(SOURCE ${CMAKE_SOURCE_DIR}/bindings/host.c APPEND PROPERTY COMPILE_DEFINITIONS
             "MOE_LUA_INSTALL_REL=\"${moe_host_lua_rel}\""
             "MOE_LUA_CINSTALL_REL=\"${moe_host_clua_rel}\"")

# Installed RPATHs: relative for our own library; absolute only for
# libraries outside the system's folders (CUDA, NCCL), as linked.
foreach(v moe_host_lib_rel moe_module_lib_rel)
  if(${v} STREQUAL ".")
    set(${v}_origin "$ORIGIN")
  else()
    set(${v}_origin "$ORIGIN/${${v}}")
  endif()
endforeach()
set_target_properties(moe-lua PROPERTIES INSTALL_RPATH "${moe_host_lib_rel_origin}"
                                         INSTALL_RPATH_USE_LINK_PATH ON)
set_target_properties(moe PROPERTIES INSTALL_RPATH "${moe_module_lib_rel_origin}"
                                     INSTALL_RPATH_USE_LINK_PATH ON)
set_target_properties(moe_core PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)

install(TARGETS moe-lua RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}")
install(TARGETS moe_core LIBRARY DESTINATION "${moe_core_dest}")
install(TARGETS moe LIBRARY DESTINATION "${MOE_INSTALL_LUA_CDIR}")
install(DIRECTORY ${CMAKE_SOURCE_DIR}/lua/ DESTINATION "${MOE_INSTALL_LUADIR}"
        FILES_MATCHING PATTERN "*.lua")
install(DIRECTORY ${CMAKE_SOURCE_DIR}/experiments/
        DESTINATION "${CMAKE_INSTALL_DATADIR}/moe-lua/experiments"
        FILES_MATCHING PATTERN "*.lua")

if(NOT MOE_LUAROCKS)
  file(GLOB moe_public_headers ${CMAKE_SOURCE_DIR}/core/moe.h ${CMAKE_SOURCE_DIR}/core/moe_*.h)
  install(FILES ${moe_public_headers} DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/moe")

  # moe.pc: every path from ${pcfiledir}, so that it moves with the prefix
  # (absolute install dirs are written as they are).
  set(moe_pc_dir "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
  moe_install_rel(MOE_PC_PREFIX "${moe_pc_dir}" "")
  set(MOE_PC_PREFIX "\${pcfiledir}/${MOE_PC_PREFIX}")
  if(IS_ABSOLUTE "${moe_pc_dir}")
    set(MOE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  endif()
  foreach(d LIBDIR INCLUDEDIR LUADIR LUA_CDIR)
    if(d MATCHES "^LUA")
      set(dir "${MOE_INSTALL_${d}}")
    else()
      set(dir "${CMAKE_INSTALL_${d}}")
    endif()
    if(IS_ABSOLUTE "${dir}")
      set(MOE_PC_${d} "${dir}")
    else()
      set(MOE_PC_${d} "\${prefix}/${dir}")
    endif()
  endforeach()
  configure_file(${CMAKE_SOURCE_DIR}/cmake/moe.pc.in ${CMAKE_BINARY_DIR}/moe.pc @ONLY)
  install(FILES ${CMAKE_BINARY_DIR}/moe.pc DESTINATION "${moe_pc_dir}")
endif()
