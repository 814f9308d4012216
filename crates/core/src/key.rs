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
    /// The lock's identity: the key's bytes, plus the bucket suffix for a bucket.
    identity: Vec<u8>,
    stored: Vec<u8>,
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
        let mut identity = Vec::with_capacity(prefix.len() + key.len());
        identity.extend_from_slice(prefix.as_bytes());
        identity.extend_from_slice(key.as_bytes());
        if let Some(b) = bucket {
            identity.push(BUCKET_MARK);
            identity.extend_from_slice(b.to_string().as_bytes());
        }
        // SHA-256 rather than a fast hash: two identities with the same digest would be one
        // lock, and keys can come from users, so collisions must be infeasible to construct,
        // not just unlikely.
        let stored = stored_form(&identity);
        // Pushed, not `format!`ted: built on every acquire, where the formatter's cost shows.
        let mut text = String::with_capacity(prefix.len() + key.len());
        text.push_str(prefix);
        text.push_str(key);
        Ok(Self {
            text,
            given_from: prefix.len(),
            bucket,
            identity,
            stored,
        })
    }

    /// The bucket number, for a bucket of a key.
    pub fn bucket_number(&self) -> Option<u32> {
        self.bucket
    }

    /// Where the lock is placed on the ring: its identity bytes (for a plain key, the key
    /// itself), so that the buckets of one key land on shards independently.
    pub fn placement(&self) -> &[u8] {
        &self.identity
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
        &self.stored
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
        self.stored.first() == Some(&DIGEST_MARK)
    }
}

/// The bytes a lock of `identity` is stored as: itself, or past the column's width a digest.
fn stored_form(identity: &[u8]) -> Vec<u8> {
    if identity.len() <= MAX_STORED_KEY_BYTES {
        identity.to_vec()
    } else {
        let mut stored = Vec::with_capacity(33);
        stored.push(DIGEST_MARK);
        stored.extend_from_slice(&Sha256::digest(identity));
        stored
    }
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

    #[test]
    fn keys_differing_in_case_differ() {
        assert_ne!(
            LockKey::new("Order:1").unwrap().stored(),
            LockKey::new("order:1").unwrap().stored()
        );
    }
}
