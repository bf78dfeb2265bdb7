#!/usr/bin/env bash
# tests/install/install_test.sh - `cmake --install` gives a moe-lua that needs
# neither the build tree nor the source tree, and a prefix that can be moved.
#
#   bash tests/install/install_test.sh BUILD_DIR SOURCE_DIR [--sanitize]
#
# Installs BUILD_DIR into a fresh temporary prefix, moves the prefix to
# another folder (so nothing can rely on the path it was installed to), and
# then, with the source and build trees hidden under empty tmpfs mounts in a
# private mount namespace (`unshare -rm`; where that is not allowed, e.g. in
# a container without user namespaces, the trees stay visible and the path
# checks below carry the test), in an empty environment (env -i):
#   - the moved moe-lua resolves libmoe_core.so from the prefix (ldd), has
#     only the prefix's folders, never the source's, on package.path and
#     package.cpath, and loads moe.lib from the prefix;
#   - it trains the installed experiments/quickstart.lua for 2 steps on the
#     CPU (a tiny model; the Bible corpus from Debian's bible-kjv, written
#     into the run's own data/);
#   - stock lua5.4 loads the installed module with LUA_PATH/LUA_CPATH
#     pointing at the prefix (not in the sanitizer build: an ASan-built
#     module cannot load into a plain interpreter);
#   - a C program builds with `pkg-config --cflags --libs moe` of the moved
#     prefix and runs (not in the sanitizer build either).
# Prints "install ok" at the end; any failed check exits 1 with its reason.
set -euo pipefail

fail() { echo "FAIL: $*" >&2; exit 1; }

# ------------------------------------------------------- inside the namespace
# Runs the checks; called in the mount namespace (or directly without one).
checks() {
  local P=$1 SRC=$2 BUILD=$3 sanitize=$4 work=$5
  cd "$work"
  local run=(env -i PATH=/usr/bin:/bin HOME="$work/home" LANG=C)
  mkdir -p "$work/home" "$work/run"

  # the loader finds our library in the prefix
  local core
  core=$(ldd "$P/bin/moe-lua" | awk '/libmoe_core/ {print $3}')
  core=$(realpath -e "$core" 2>/dev/null || echo "${core:-nothing}")
  [ "$core" = "$P/lib/libmoe_core.so" ] || fail "moe-lua loads libmoe_core.so from '$core', not $P/lib"

  # Lua's search paths: the prefix first, nothing from the source or build tree
  local out
  out=$("${run[@]}" T_PREFIX="$P" T_SRC="$SRC" T_BUILD="$BUILD" "$P/bin/moe-lua" -e '
    local P, SRC, BUILD = os.getenv("T_PREFIX"), os.getenv("T_SRC"), os.getenv("T_BUILD")
    local function has(s, dir) return s:find(dir, 1, true) ~= nil end
    for _, k in ipairs { "path", "cpath" } do
      local s = package[k]
      assert(not has(s, SRC) and not has(s, BUILD), "package." .. k .. " names the source or build tree: " .. s)
    end
    assert(package.path:sub(1, #P + 1) == P .. "/", "package.path does not start with the prefix: " .. package.path)
    assert(package.cpath:sub(1, #P + 1) == P .. "/", "package.cpath does not start with the prefix: " .. package.cpath)
    local moe = require "moe"
    require "moe.train"
    for name in pairs(package.loaded) do
      if name:match("^moe%.") and name ~= "moe.host" then
        local file = package.searchpath(name, package.path)
        assert(file and has(file, P .. "/share/lua/"), name .. " resolves to " .. tostring(file))
      end
    end
    local src = debug.getinfo(moe.config, "S").source
    assert(has(src, P .. "/share/lua/"), "moe.config comes from " .. src)
    print("paths ok " .. moe.version)' 2>&1) || fail "moe-lua -e: $out"
  echo "$out"
  "${run[@]}" "$P/bin/moe-lua" --version >/dev/null || fail "moe-lua --version failed"

  # a tiny training run of the installed quickstart, from a folder of its own
  out=$(cd "$work/run" && "${run[@]}" "$P/bin/moe-lua" "$P/share/moe-lua/experiments/quickstart.lua" \
        steps=2 warmup=0 device=cpu model.d_model=32 model.n_layers=1 model.n_heads=2 \
        model.moe.ffn_hidden_size=32 seq_len=32 batch_size=2 eval_iters=1 sample_tokens=8 2>&1) ||
    fail "installed quickstart failed: $out"
  echo "$out" | grep -q "^quickstart: 2 steps" || fail "installed quickstart did not train 2 steps: $out"
  [ -f "$work/run/out/quickstart/ckpt-2/model.safetensors" ] || fail "installed quickstart wrote no checkpoint"
  echo "quickstart ok"

  [ "$sanitize" = 1 ] && return 0

  # stock lua5.4 with the prefix on LUA_PATH / LUA_CPATH
  if command -v lua5.4 >/dev/null; then
    out=$(env -i PATH=/usr/bin:/bin HOME="$work/home" T_PREFIX="$P" \
          LUA_PATH="$P/share/lua/5.4/?.lua;$P/share/lua/5.4/?/init.lua;;" LUA_CPATH="$P/lib/lua/5.4/?.so;;" \
          lua5.4 -e '
      local P = os.getenv("T_PREFIX")
      local moe = require "moe"
      local so = package.searchpath("moe", package.cpath)
      assert(so == P .. "/lib/lua/5.4/moe.so", "moe.so from " .. tostring(so))
      local src = debug.getinfo(moe.config, "S").source
      assert(src:find(P .. "/share/lua/5.4/", 1, true), "moe.config from " .. src)
      assert(moe.arange(4):sum():item() == 6)
      print("stock lua5.4 ok")' 2>&1) || fail "lua5.4 require \"moe\": $out"
    echo "$out"
  else
    echo "NOTE: no lua5.4, the stock interpreter check is left out"
  fi

  # a C program against the moved prefix's moe.pc
  if command -v cc >/dev/null && command -v pkg-config >/dev/null; then
    cat >"$work/app.c" <<'EOF'
#include <moe.h>
#include <stdio.h>
int main(void) {
  moe_ctx *ctx;
  moe_tensor *t, *s;
  if (moe_ctx_init(&ctx) != MOE_OK) return 1;
  if (moe_arange(ctx, 0, 5, 1, MOE_F32, MOE_CPU, &t) != MOE_OK) return 2;
  if (moe_sum(ctx, t, 0, NULL, false, &s) != MOE_OK) return 3;
  printf("sum %g\n", (double)*(float *)moe_tensor_data(s));
  moe_tensor_release(s);
  moe_tensor_release(t);
  moe_ctx_free(ctx);
  return 0;
}
EOF
    local flags
    flags=$(PKG_CONFIG_PATH="$P/lib/pkgconfig" pkg-config --cflags --libs moe) || fail "pkg-config moe failed"
    # shellcheck disable=SC2086
    cc -o "$work/app" "$work/app.c" $flags -Wl,-rpath,"$P/lib" || fail "cc with \`pkg-config moe\` failed: $flags"
    out=$(env -i "$work/app" 2>&1) || fail "the C program failed: $out"
    [ "$out" = "sum 10" ] || fail "the C program printed '$out', not 'sum 10'"
    echo "pkg-config ok"
  else
    echo "NOTE: no cc or pkg-config, the C program check is left out"
  fi
}

if [ "${1:-}" = "--inside" ]; then
  # the namespace's half: hide the trees, then check
  shift
  P=$1 SRC=$2 BUILD=$3 sanitize=$4 work=$5
  cd /
  mount -t tmpfs -o size=1m moe-hidden "$SRC"
  [ "$BUILD" = "$SRC" ] || [ "${BUILD#"$SRC"/}" != "$BUILD" ] || mount -t tmpfs -o size=1m moe-hidden "$BUILD"
  [ -z "$(ls -A "$SRC")" ] || fail "the source tree is still visible"
  checks "$P" "$SRC" "$BUILD" "$sanitize" "$work"
  exit 0
fi

# ------------------------------------------------------------------ outside
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR SOURCE_DIR [--sanitize]" >&2; exit 2; }
BUILD=$(cd "$1" && pwd -P)
SRC=$(cd "$2" && pwd -P)
sanitize=0
[ "${3:-}" = "--sanitize" ] && sanitize=1

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-install.XXXXXX")
tmp=$(cd "$tmp" && pwd -P)
trap 'rm -rf "$tmp"' EXIT
case "$tmp/" in "$SRC"/* | "$BUILD"/*) fail "the temporary folder $tmp is inside the source or build tree" ;; esac

"${CMAKE:-cmake}" --install "$BUILD" --prefix "$tmp/installed" >"$tmp/install.log" 2>&1 ||
  fail "cmake --install failed: $(cat "$tmp/install.log")"
for f in bin/moe-lua lib/libmoe_core.so lib/lua/5.4/moe.so share/lua/5.4/moe/lib.lua include/moe/moe.h \
         lib/pkgconfig/moe.pc share/moe-lua/experiments/quickstart.lua; do
  [ -e "$tmp/installed/$f" ] || fail "cmake --install did not install $f"
done
! grep -rqF "$tmp/installed" "$tmp/installed/lib/pkgconfig/moe.pc" || fail "moe.pc names the install prefix"

# moved: the prefix it was installed to is gone
mkdir -p "$tmp/moved"
mv "$tmp/installed" "$tmp/moved/prefix"
P="$tmp/moved/prefix"
mkdir -p "$tmp/work"
cp "$0" "$tmp/install_test.sh" # the namespace hides this file's folder

if unshare -rm true 2>/dev/null; then
  echo "source and build trees hidden (mount namespace)"
  unshare -rm bash "$tmp/install_test.sh" --inside "$P" "$SRC" "$BUILD" "$sanitize" "$tmp/work"
else
  echo "NOTE: no mount namespace here (unshare -rm failed): the source and build trees stay" \
       "visible; the path checks stand for their absence"
  checks "$P" "$SRC" "$BUILD" "$sanitize" "$tmp/work"
fi
echo "install ok"
