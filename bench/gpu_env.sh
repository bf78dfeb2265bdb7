# Sourced by the bench/*.sh rounds that run on a GPU machine over a build made here and packed
# with `bash .ci/gpu --pack` (carried as out/gpu-pack.tgz, unpacked there first). With root set
# to the repository: sets out ($OUT, default $root/out, created), enters $root, points build-gpu
# at the carried .deps/gpu and /work/main at the copy (the build's absolute paths), and exports
# LUA_PATH and LUA_CPATH for the carried Lua libraries (the GPU machine has no Lua).
out=${OUT:-$root/out}; mkdir -p "$out"
cd "$root" || exit 1
[ -e build-gpu ] || ln -s "$root/.deps/gpu" build-gpu
if [ "$root" != /work/main ] && [ ! -e /work/main ]; then mkdir -p /work && ln -s "$root" /work/main; fi
export LUA_PATH="$root/.deps/lua/share/?.lua;$root/.deps/lua/share/?/init.lua;;"
export LUA_CPATH="$root/.deps/lua/lib/?.so;;"
