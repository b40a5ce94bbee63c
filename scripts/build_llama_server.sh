#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (the serving peer of `kvserve bench serve --url`) from the
# llama.cpp source that llama-cpp-python's sdist vendors (the same version the benchmarks' Python
# peer runs), once, into $KVSERVE_CACHE (default ~/.cache/kvserve)/llama_cpp/llama-server.
# About 6-10 minutes on 2 cores; says how long it took. Needs cmake and a C++ compiler; no network
# beyond the package index.
set -euo pipefail
version=0.3.36
cache="${KVSERVE_CACHE:-$HOME/.cache/kvserve}/llama_cpp"
target="$cache/llama-server"
if [[ -x "$target" ]]; then
    echo "llama-server already built: $target"
    exit 0
fi
command -v cmake >/dev/null || { echo "build_llama_server.sh: cmake is needed (apt install cmake, or pip install cmake)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS
python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
echo "building llama-server from llama.cpp as llama-cpp-python $version vendors it (about 6-10 minutes on 2 cores)..."
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF > "$work/cmake.log" 2>&1
cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
mkdir -p "$cache"
cp "$work/build/bin/llama-server" "$target.partial"
mv "$target.partial" "$target"
echo "llama-server built in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s: $target"
