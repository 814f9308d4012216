//! Lock keys: validation and the bytes stored as the lease row's primary key.

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// The longest key accepted, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 1024;

/// Keys longer than this many bytes are stored as a digest (see [`LockKey::stored`]). It is
/// the width of the `lock_key VARBINARY(255)` columns. Every session runs in strict SQL mode,
/// which makes a longer value an error; without it the server would truncate it, and two long
/// keys sharing a prefix would silently become one lock.
pub const MAX_STORED_KEY_BYTES: usize = 255;

/// Marks a digest in the stored key. It is `0xFF`, a byte that never occurs in UTF-8, so a
/// digest can never equal a literal key.
const DIGEST_MARK: u8 = 0xFF;

/// Separates a key from its bucket number. `0xFE` never occurs in UTF-8 either, so a bucket's
/// lock can never equal a literal key.
const BUCKET_MARK: u8 = 0xFE;

/// A validated lock key and the bytes that identify it on its shard.
///
/// Keys are compared byte for byte: `Order:1` and `order:1` are different locks. A key of at
/// most [`MAX_STORED_KEY_BYTES`] bytes is stored as itself. A longer key (up to
/// [`MAX_KEY_BYTES`]) is stored as `0xFF` followed by the 32-byte SHA-256 of the key; the
/// marker byte cannot appear in UTF-8, so digests and literal keys never collide.
///
/// A bucket of a key (see [`LockKey::bucket`]) is its own lock, identified by the key's bytes,
/// `0xFE` and the bucket number in decimal, stored (or digested) the same way.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LockKey {
    /// The lock's name as text: its namespace's prefix (if any), then the key as given.
    text: String,
    /// Where the key as given starts in `text`.
    given_from: usize,
    bucket: Option<u32>,
    /// A bucket's identity: `text`'s bytes, the bucket mark and the bucket number. A plain
    /// key's identity is `text` itself, so it carries none.
    bucket_identity: Option<Vec<u8>>,
    /// The digest form, when the identity is longer than the column; else the identity is
    /// stored as it is. A plain key that fits is thus one allocation: keys are built on every
    /// acquire, and three allocations per key showed in the in-memory hand-off.
    digest: Option<Vec<u8>>,
}

impl LockKey {
    /// Validates `key`: non-empty and at most [`MAX_KEY_BYTES`] bytes.
    pub fn new(key: &str) -> Result<Self> {
        Self::build(key, None)
    }

    /// Bucket `bucket` of `key`: one of the independent sub-locks a hot key is split into.
    pub fn bucket(key: &str, bucket: u32) -> Result<Self> {
        Self::build(key, Some(bucket))
    }

    /// This key in the scope `prefix` (a namespace's `key-prefix`): the lock whose identity
    /// is `prefix` followed by the key's bytes, placed and stored as such. The key as the
    /// caller wrote it ([`LockKey::as_str`]) and its bucket stay.
    /// Scoping a key again in the same scope returns it as it is.
    pub fn scoped(self, prefix: &str) -> Self {
        if self.given_from == prefix.len() && self.text.starts_with(prefix) {
            return self;
        }
        Self::build_in(prefix, self.as_str(), self.bucket)
            .expect("a valid key stays valid under a prefix")
    }

    fn build(key: &str, bucket: Option<u32>) -> Result<Self> {
        Self::build_in("", key, bucket)
    }

    fn build_in(prefix: &str, key: &str, bucket: Option<u32>) -> Result<Self> {
        if key.is_empty() {
            return Err(Error::InvalidKey {
                reason: "the key is empty".into(),
            });
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::InvalidKey {
                reason: format!(
                    "the key is {} bytes long; the limit is {MAX_KEY_BYTES} bytes \
                     (hash long identifiers into the key yourself if they can grow)",
                    key.len()
                ),
            });
        }
        // Pushed, not `format!`ted: built on every acquire, where the formatter's cost shows.
        let mut text = String::with_capacity(prefix.len() + key.len());
        text.push_str(prefix);
        text.push_str(key);
        let bucket_identity = bucket.map(|b| {
            let mut identity = text.clone().into_bytes();
            identity.push(BUCKET_MARK);
            identity.extend_from_slice(b.to_string().as_bytes());
            identity
        });
        let identity = bucket_identity.as_deref().unwrap_or(text.as_bytes());
        let digest = (identity.len() > MAX_STORED_KEY_BYTES).then(|| digest_form(identity));
        Ok(Self {
            text,
            given_from: prefix.len(),
            bucket,
            bucket_identity,
            digest,
        })
    }

    /// The bucket number, for a bucket of a key.
    pub fn bucket_number(&self) -> Option<u32> {
        self.bucket
    }

    /// Where the lock is placed on the ring: its identity bytes (for a plain key, the key
    /// itself), so that the buckets of one key land on shards independently.
    pub fn placement(&self) -> &[u8] {
        self.bucket_identity
            .as_deref()
            .unwrap_or(self.text.as_bytes())
    }

    /// The key as the caller wrote it.
    pub fn as_str(&self) -> &str {
        &self.text[self.given_from..]
    }

    /// The key with its namespace's prefix: the lock as tools (`inspect`, `list`) name it.
    pub fn scoped_str(&self) -> &str {
        &self.text
    }

    /// A short stable digest of the key (`#` and 16 hex digits), for telemetry that must not
    /// carry the key itself: the same key gives the same label in every process.
    ///
    /// SipHash with a fixed zero key, so that every process and release agrees. That also
    /// means it is not a secret: anyone can hash a guess, and a key drawn from a small space
    /// (`user:<id>`) is recovered by hashing all of them. It keeps keys out of sight, not out
    /// of reach. Buckets of one key get labels of their own (the stored bytes are hashed).
    pub fn label_hash(&self) -> String {
        Self::stored_label_hash(self.stored())
    }

    /// [`LockKey::label_hash`] of the plain lock named `name` (a [`LockKey::scoped_str`]),
    /// whatever its length.
    pub fn name_label_hash(name: &str) -> String {
        Self::stored_label_hash(&stored_form(name.as_bytes()))
    }

    /// [`LockKey::label_hash`] of the key stored as `stored` (a lease row's primary key).
    pub fn stored_label_hash(stored: &[u8]) -> String {
        use std::hash::Hasher;
        let mut h = siphasher::sip::SipHasher13::new_with_keys(0, 0);
        h.write(stored);
        format!("#{:016x}", h.finish())
    }

    /// The bytes stored in the lease row's primary key.
    pub fn stored(&self) -> &[u8] {
        self.digest.as_deref().unwrap_or(self.placement())
    }

    /// The placement bytes (see [`LockKey::placement`]) of a lock stored as `stored`, or
    /// `None` when it is stored as a digest (its placement cannot be recovered).
    ///
    /// What lets a reload's carry tell where a row found on a shard belongs now. For a digest
    /// it cannot, so the facade copies such a row's fence to every shard and leaves an owned
    /// CAS row of it in place, with the move in force, until it is released.
    pub fn placement_of_stored(stored: &[u8]) -> Option<&[u8]> {
        (stored.first() != Some(&DIGEST_MARK)).then_some(stored)
    }

    /// How a lock stored as `stored` reads: its key (with any namespace prefix) and bucket, or
    /// for a key stored as a digest, its label ([`LockKey::stored_label_hash`]) and `None`
    /// (neither can be recovered from the digest).
    pub fn describe_stored(stored: &[u8]) -> (String, Option<u32>) {
        if stored.first() == Some(&DIGEST_MARK) {
            return (Self::stored_label_hash(stored), None);
        }
        match stored.iter().position(|&b| b == BUCKET_MARK) {
            Some(at) => (
                String::from_utf8_lossy(&stored[..at]).into_owned(),
                std::str::from_utf8(&stored[at + 1..])
                    .ok()
                    .and_then(|n| n.parse().ok()),
            ),
            None => (String::from_utf8_lossy(stored).into_owned(), None),
        }
    }

    /// Whether the stored form is a digest.
    pub fn is_digest(&self) -> bool {
        self.digest.is_some()
    }
}

/// The bytes a lock of `identity` is stored as: itself, or past the column's width a digest.
fn stored_form(identity: &[u8]) -> Vec<u8> {
    if identity.len() <= MAX_STORED_KEY_BYTES {
        identity.to_vec()
    } else {
        digest_form(identity)
    }
}

/// The digest form of an identity longer than the column: the mark, then its SHA-256.
/// SHA-256 rather than a fast hash: two identities with the same digest would be one lock,
/// and keys can come from users, so collisions must be infeasible to construct, not just
/// unlikely.
fn digest_form(identity: &[u8]) -> Vec<u8> {
    let mut stored = Vec::with_capacity(33);
    stored.push(DIGEST_MARK);
    stored.extend_from_slice(&Sha256::digest(identity));
    stored
}

impl std::fmt::Display for LockKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)?;
        if let Some(b) = self.bucket {
            write!(f, " (bucket {b})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scoped_key_is_the_prefixed_lock_and_keeps_its_text_and_bucket() {
        let key = LockKey::new("order:1").unwrap().scoped("billing/");
        assert_eq!(key.stored(), b"billing/order:1");
        assert_eq!(key.placement(), b"billing/order:1");
        assert_eq!(key.as_str(), "order:1");
        assert_eq!(key.scoped_str(), "billing/order:1");
        assert_eq!(key.clone().scoped("billing/"), key, "scoped once");
        assert_eq!(
            LockKey::name_label_hash("billing/order:1"),
            key.label_hash()
        );
        assert_eq!(key.to_string(), "billing/order:1");
        // The same lock as the plain key spelled with the prefix (tools name it so).
        assert_eq!(
            key.stored(),
            LockKey::new("billing/order:1").unwrap().stored()
        );
        let bucket = LockKey::bucket("sku:1", 3).unwrap().scoped("stock/");
        assert_eq!(bucket.bucket_number(), Some(3));
        assert_eq!(bucket.stored(), b"stock/sku:1\xFE3");
        // A long key under a prefix is digested like any other.
        let long = LockKey::new(&"k".repeat(250)).unwrap().scoped("billing/");
        assert!(long.is_digest());
        assert_eq!(
            LockKey::describe_stored(bucket.stored()),
            ("stock/sku:1".to_owned(), Some(3))
        );
        assert_eq!(
            LockKey::describe_stored(long.stored()),
            (long.label_hash(), None)
        );
        assert_eq!(
            LockKey::describe_stored(key.stored()),
            ("billing/order:1".to_owned(), None)
        );
    }

    #[test]
    fn rejects_empty_and_oversized_keys() {
        assert!(matches!(LockKey::new(""), Err(Error::InvalidKey { .. })));
        let big = "k".repeat(2048);
        let err = LockKey::new(&big).unwrap_err();
        assert!(err.to_string().contains("2048 bytes"), "{err}");
        assert!(LockKey::new(&"k".repeat(MAX_KEY_BYTES)).is_ok());
    }

    #[test]
    fn short_keys_are_stored_literally_long_keys_as_digest() {
        let k = LockKey::new("order:1").unwrap();
        assert_eq!(k.stored(), b"order:1");
        assert!(!k.is_digest());
        let long = "x".repeat(MAX_STORED_KEY_BYTES + 1);
        let d = LockKey::new(&long).unwrap();
        assert!(d.is_digest());
        assert_eq!(d.stored().len(), 33);
        assert_ne!(
            d.stored(),
            LockKey::new(&"x".repeat(MAX_STORED_KEY_BYTES + 2))
                .unwrap()
                .stored()
        );
    }

    #[test]
    fn buckets_are_locks_of_their_own_that_no_literal_key_can_name() {
        let b3 = LockKey::bucket("sku:42", 3).unwrap();
        assert_eq!(b3.stored(), b"sku:42\xfe3");
        assert_ne!(b3.stored(), LockKey::bucket("sku:42", 4).unwrap().stored());
        assert_ne!(b3.stored(), LockKey::new("sku:42").unwrap().stored());
        assert_eq!(b3.bucket_number(), Some(3));
        assert_eq!(b3.to_string(), "sku:42 (bucket 3)");
        let long = LockKey::bucket(&"k".repeat(MAX_STORED_KEY_BYTES), 0).unwrap();
        assert!(long.is_digest());
        assert_eq!(LockKey::new("plain").unwrap().placement(), b"plain");
    }

    /// The stored bytes are the row's primary key: any change to them makes one lock two
    /// across versions. Pinned here byte for byte, at the column's width and past it, for
    /// plain, prefixed and bucket keys.
    #[test]
    fn stored_bytes_are_pinned_at_the_width_and_past_it() {
        let digest = |identity: &[u8]| {
            let mut d = vec![DIGEST_MARK];
            d.extend_from_slice(&Sha256::digest(identity));
            d
        };
        let fits = "w".repeat(MAX_STORED_KEY_BYTES);
        assert_eq!(LockKey::new(&fits).unwrap().stored(), fits.as_bytes());
        let over = "w".repeat(MAX_STORED_KEY_BYTES + 1);
        assert_eq!(
            LockKey::new(&over).unwrap().stored(),
            digest(over.as_bytes())
        );
        // The digest itself, as written: `sha256sum` of 256 `w`s, after the mark.
        let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(LockKey::new(&over).unwrap().stored()),
            "ff38bc2286bb38fa85cbfdfd496efb50dfd1a879f1bab3bd8d93dee14a3ea68203"
        );
        let scoped = LockKey::new(&"w".repeat(MAX_STORED_KEY_BYTES - 1))
            .unwrap()
            .scoped("ab");
        let identity = format!("ab{}", "w".repeat(MAX_STORED_KEY_BYTES - 1));
        assert_eq!(scoped.stored(), digest(identity.as_bytes()));
        assert_eq!(scoped.placement(), identity.as_bytes());
        let bucket = LockKey::bucket(&"w".repeat(MAX_STORED_KEY_BYTES - 2), 7).unwrap();
        let mut identity = "w".repeat(MAX_STORED_KEY_BYTES - 2).into_bytes();
        identity.extend_from_slice(b"\xfe7");
        assert_eq!(bucket.stored(), identity.as_slice());
        assert_eq!(bucket.placement(), identity.as_slice());
        let bucket = LockKey::bucket(&"w".repeat(MAX_STORED_KEY_BYTES - 1), 12).unwrap();
        let mut identity = "w".repeat(MAX_STORED_KEY_BYTES - 1).into_bytes();
        identity.extend_from_slice(b"\xfe12");
        assert_eq!(bucket.stored(), digest(&identity));
        assert_eq!(
            hex(bucket.stored()),
            "ff5a5c90f2a2c9ee73515432068efd1c66e363a62d03198bfbe48e5192ac8b919d"
        );
        assert_eq!(bucket.placement(), identity.as_slice());
        let scoped_bucket = LockKey::bucket("sku", 2).unwrap().scoped("p/");
        assert_eq!(scoped_bucket.stored(), b"p/sku\xfe2");
        assert_eq!(scoped_bucket.as_str(), "sku");
        assert_eq!(scoped_bucket.scoped_str(), "p/sku");
    }

    #[test]
    fn keys_differing_in_case_differ() {
        assert_ne!(
            LockKey::new("Order:1").unwrap().stored(),
            LockKey::new("order:1").unwrap().stored()
        );
    }
}
