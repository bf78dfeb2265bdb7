-- LuaRocks: `luarocks make` in a checkout builds moe-lua with CMake and
-- installs `require "moe"` into a LuaRocks tree for stock lua5.4:
--
--   luarocks make --local                     # ~/.luarocks
--   eval "$(luarocks path)"; lua5.4 -e 'print(require "moe".version)'
--
-- The system packages come first (bash .ci/deps: liblua5.4-dev, OpenBLAS,
-- Open MPI, cmake, pkg-config; the CUDA toolkit for the GPU backend, used
-- when nvcc is found). The tree gets lib/lua/5.4/moe.so with
-- libmoe_core.so beside it, share/lua/5.4/moe/ (the Lua library) and
-- bin/moe-lua; cmake/MoeInstall.cmake (MOE_LUAROCKS) has the layout.
rockspec_format = "3.0"
package = "moe-lua"
version = "scm-1"
source = {
  -- `luarocks make` builds the checkout it runs in; this is read only by
  -- `luarocks install`/`download`, from a clone of this repository.
  url = "git+file://.",
}
description = {
  summary = "Dropless Mixture-of-Experts training: a C core with CUDA kernels, driven by Lua 5.4",
  detailed = [[
The `moe` module (tensors, autograd, MoE routing, grouped and block-sparse
expert kernels, MPI/NCCL collectives) and its Lua library (nn, routers,
experts, layers, optim, data, train), plus the moe-lua host.]],
  labels = { "machine-learning", "cuda", "mixture-of-experts" },
}
dependencies = {
  "lua >= 5.4, < 5.5",
}
build = {
  type = "cmake",
  variables = {
    CMAKE_BUILD_TYPE = "Release",
    CMAKE_INSTALL_PREFIX = "$(PREFIX)",
    CMAKE_INSTALL_BINDIR = "$(BINDIR)",
    MOE_INSTALL_LUADIR = "$(LUADIR)",
    MOE_INSTALL_LUA_CDIR = "$(LIBDIR)",
    MOE_LUAROCKS = "ON",
    MOE_BUILD_TESTS = "OFF",
  },
}
