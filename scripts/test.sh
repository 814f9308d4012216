#!/usr/bin/env bash
# The whole test suite: formatting, lints, docs, then every test against real MariaDB shards
# that the tests start themselves (mariadbd on loopback ports, throwaway data directories).
# Installs what is missing on a fresh Debian machine when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

need_install=()
command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || need_install+=(mariadb-server)
command -v mariadb-install-db >/dev/null 2>&1 || need_install+=(mariadb-server)
# libfaketime runs shards whose clocks are skewed, drifting or stepped.
compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null || need_install+=(faketime)
if [ ${#need_install[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need_install[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_install[@]}" >/dev/null
  else
    echo "the tests need: sudo apt-get install ${need_install[*]}" >&2
    exit 1
  fi
fi
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest"
  cargo install --locked cargo-nextest
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
RUSTDOCFLAGS="-D warnings -D rustdoc::broken_intra_doc_links" cargo doc --workspace --no-deps --locked --quiet
# nextest does not run doctests; run them first so that nextest's summary closes the output.
cargo test --doc --workspace --locked
profile=default
[ "${CI:-}" = true ] && profile=ci
cargo nextest run --workspace --locked --profile "$profile"
