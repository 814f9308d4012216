#!/usr/bin/env bash
# The whole test suite: formatting, lints, docs, then every test against real MariaDB shards
# that the tests start themselves (mariadbd on loopback ports, throwaway data directories).
# Installs what is missing on a fresh Debian machine when run as root.
set -euo pipefail
cd "$(dirname "$0")/.."
# One full build, not an edit loop: incremental caches would only double what the build writes
# to disk (1.5 GB of it).
export CARGO_INCREMENTAL=0

need_install=()
command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ] || need_install+=(mariadb-server)
command -v mariadb-install-db >/dev/null 2>&1 || need_install+=(mariadb-server)
# libfaketime runs shards whose clocks are skewed, drifting or stepped.
compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null || need_install+=(faketime)
# A real Prometheus evaluates the ops dashboard's queries against a scraped application.
[ -x /usr/bin/prometheus ] || need_install+=(prometheus)
# Galera shards: the provider, and what its state transfers run (mariabackup over socat).
[ -f /usr/lib/galera/libgalera_smm.so ] || need_install+=(galera-4)
command -v mariabackup >/dev/null 2>&1 || need_install+=(mariadb-backup)
command -v socat >/dev/null 2>&1 || need_install+=(socat)
if [ ${#need_install[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing ${need_install[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_install[@]}" >/dev/null
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
cargo clippy --workspace --all-targets --all-features --locked -- -D warnings
# The command operators install: without the dev tools (demo, bench, dev shards).
cargo clippy -p shardlock-cli --locked -- -D warnings
# The library's default build only emits: no exporter, HTTP client or server, Prometheus crate
# or C zlib in its tree, and it builds so.
heavy='^(reqwest|hyper|hyper-util|http|http-body|tower|tower-http|prometheus|opentelemetry-otlp|opentelemetry-prometheus|libz-sys) v'
if cargo tree -p shardlock -e normal --no-default-features --prefix none --locked | grep -E "$heavy"; then
  echo "the crates above are in shardlock's default build" >&2
  exit 1
fi
cargo clippy -p shardlock --no-default-features --locked -- -D warnings
# Every crate packages as it would be published (sources it includes are inside it, every
# dependency it publishes with has a version). Not built again from the packages here: that
# is a second build of every dependency; `cargo package --workspace` does it.
cargo package --workspace --no-verify --locked --allow-dirty --quiet
RUSTDOCFLAGS="-D warnings -D rustdoc::broken_intra_doc_links" cargo doc --workspace --no-deps --locked --quiet
# nextest does not run doctests; run them first so that nextest's summary closes the output.
cargo test --doc --workspace --locked
# Every example, as a reader would run it, against the dev shards the testkit starts
# (`shardlock dev up`; stopped again only if started here); lease_scale starts shards of its
# own. Each exits non-zero on error.
cargo build --examples --locked --quiet
shardlock=(cargo run --locked --quiet -p shardlock-cli --features dev-tools --)
dev_up=$("${shardlock[@]}" dev up)
case "$dev_up" in
  *"(0 started now)"*) ;;
  # Started here: stopped again however the examples end.
  *) trap '"${shardlock[@]}" dev down >/dev/null' EXIT ;;
esac
for example in cas_lock fenced_write http_lock job_queue leader_election list_leases scheduled_job semaphore state_claim tx_lock; do
  echo "example $example"
  cargo run --locked --quiet --example "$example" >/dev/null
done
echo "example lease_scale 2000"
cargo run --locked --quiet --example lease_scale -- 2000
profile=default
[ "${CI:-}" = true ] && profile=ci
cargo nextest run --workspace --all-features --locked --profile "$profile"
