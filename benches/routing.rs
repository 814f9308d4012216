//! Routing cost: placing keys on the ring and validating them (the in-process part of every
//! acquire). Run with `cargo bench --bench routing`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use shardlock::{LockKey, Ring};

fn routing(c: &mut Criterion) {
    let names: Vec<String> = (1..=8).map(|i| format!("s{i}")).collect();
    let ring = Ring::new(names.iter().map(|n| (n.as_str(), 1)), 512);
    let keys: Vec<String> = (0..1024).map(|i| format!("order:{i}")).collect();
    let mut i = 0;
    c.bench_function("ring_locate_8_shards", |b| {
        b.iter(|| {
            i = (i + 1) % keys.len();
            black_box(ring.locate(keys[i].as_bytes()))
        })
    });
    c.bench_function("lock_key_validate_long", |b| {
        let long = "k".repeat(900);
        b.iter(|| black_box(LockKey::new(black_box(&long)).unwrap()))
    });
}

criterion_group!(benches, routing);
criterion_main!(benches);
