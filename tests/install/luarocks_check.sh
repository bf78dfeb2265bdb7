#!/usr/bin/env bash
# tests/install/luarocks_check.sh - `luarocks make --local` of this checkout
# with moe-lua-scm-1.rockspec, into a throw-away HOME, then the installed
# rock: stock lua5.4 with `luarocks path` loads the module and its Lua
# library from the tree, and the tree's moe-lua trains the rock's
# quickstart for 2 steps on the CPU. Not part of ctest or CI (it builds the
# whole project again in build.luarocks/, about a minute on 2 cores with a
# warm ccache); run it by hand after changing the rockspec or the install
# rules. Needs `luarocks` (apt-get install luarocks).
#
#   bash tests/install/luarocks_check.sh [--cpu]    # --cpu: MOE_CUDA=OFF
# Prints "luarocks ok" at the end; exits 1 with the reason otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v luarocks >/dev/null || fail "luarocks is not installed (apt-get install luarocks)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-luarocks.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/home" "$tmp/run"
spec=moe-lua-scm-1.rockspec
if [ "${1:-}" = "--cpu" ]; then
  sed 's/^\(    MOE_BUILD_TESTS = "OFF",\)$/\1\n    MOE_CUDA = "OFF",/' "$spec" >"$tmp/$spec"
  grep -q 'MOE_CUDA = "OFF"' "$tmp/$spec" || fail "could not add MOE_CUDA=OFF to a copy of $spec"
  spec="$tmp/$spec"
fi

export HOME="$tmp/home" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
luarocks --lua-version 5.4 make --local "$spec" >"$tmp/make.log" 2>&1 ||
  fail "luarocks make failed: $(tail -n 30 "$tmp/make.log")"
tree="$HOME/.luarocks"
for f in bin/moe-lua lib/lua/5.4/moe.so lib/lua/5.4/libmoe_core.so share/lua/5.4/moe/lib.lua; do
  [ -e "$tree/$f" ] || fail "the rock did not deploy $f"
done

out=$(eval "$(luarocks --lua-version 5.4 path)" && T_TREE="$tree" lua5.4 -e '
  local tree = os.getenv("T_TREE")
  local moe = require "moe"
  assert(package.searchpath("moe", package.cpath) == tree .. "/lib/lua/5.4/moe.so")
  local src = debug.getinfo(moe.config, "S").source
  assert(src == "@" .. tree .. "/share/lua/5.4/moe/config.lua", "moe.config from " .. src)
  assert(moe.arange(4):sum():item() == 6)
  print("lua5.4 ok")' 2>&1) || fail "lua5.4 with luarocks path: $out"
echo "$out"

rockdir=$(luarocks --lua-version 5.4 show --rock-dir moe-lua)
out=$(cd "$tmp/run" && env -i PATH=/usr/bin:/bin HOME="$HOME" "$tree/bin/moe-lua" \
      "$rockdir/share/moe-lua/experiments/quickstart.lua" steps=2 warmup=0 device=cpu \
      model.d_model=32 model.n_layers=1 model.n_heads=2 model.moe.ffn_hidden_size=32 seq_len=32 \
      batch_size=2 eval_iters=1 sample_tokens=8 2>&1) || fail "the tree's moe-lua: $out"
echo "$out" | grep -q "^quickstart: 2 steps" || fail "the tree's moe-lua did not train: $out"
echo "moe-lua ok"
echo "luarocks ok"
