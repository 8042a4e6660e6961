//! Prepared avatars by id, least recently used evicted first, bounded by entries and bytes.

use std::collections::HashMap;
use std::sync::Arc;

use super::metrics as m;
use super::Avatar;

/// Why [`AvatarCache::insert`] did not keep an avatar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NotKept {
    #[error(
        "the prepared avatar takes {bytes} bytes, more than the whole avatar cache \
         ({max_bytes} bytes, --avatar-cache-bytes)"
    )]
    TooLarge { bytes: u64, max_bytes: u64 },
    #[error("this server keeps no avatars (--avatar-cache-entries 0)")]
    Disabled,
}

pub struct AvatarCache {
    max_entries: usize,
    max_bytes: u64,
    bytes: u64,
    tick: u64,
    entries: HashMap<String, (Arc<Avatar>, u64)>,
}

impl AvatarCache {
    pub fn new(max_entries: usize, max_bytes: u64) -> Self {
        AvatarCache {
            max_entries,
            max_bytes,
            bytes: 0,
            tick: 0,
            entries: HashMap::new(),
        }
    }

    /// The avatar, marked as recently used (counted as a hit or miss).
    pub fn get(&mut self, id: &str) -> Option<Arc<Avatar>> {
        self.tick += 1;
        let tick = self.tick;
        match self.entries.get_mut(id) {
            Some((a, used)) => {
                *used = tick;
                metrics::counter!(m::AVATAR_CACHE_HITS).increment(1);
                Some(a.clone())
            }
            None => {
                metrics::counter!(m::AVATAR_CACHE_MISSES).increment(1);
                None
            }
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// Stores an avatar, evicting the least recently used ones to stay within the bounds.
    /// An avatar larger than the whole byte budget (or any avatar, when the cache keeps no
    /// entries) is not kept: the error says why, and the cache is left as it was.
    pub fn insert(&mut self, id: String, avatar: Arc<Avatar>) -> Result<(), NotKept> {
        let size = avatar.bytes() as u64;
        self.admits(size)?;
        self.remove(&id);
        while !self.entries.is_empty()
            && (self.entries.len() >= self.max_entries || self.bytes + size > self.max_bytes)
        {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            self.remove(&oldest);
        }
        self.tick += 1;
        self.bytes += size;
        self.entries.insert(id, (avatar, self.tick));
        self.publish();
        Ok(())
    }

    /// Whether an avatar of `size` bytes ([`Avatar::bytes`]) would be kept (what
    /// [`AvatarCache::insert`] checks first).
    pub fn admits(&self, size: u64) -> Result<(), NotKept> {
        if self.max_entries == 0 {
            return Err(NotKept::Disabled);
        }
        if size > self.max_bytes {
            return Err(NotKept::TooLarge {
                bytes: size,
                max_bytes: self.max_bytes,
            });
        }
        Ok(())
    }

    pub fn remove(&mut self, id: &str) -> bool {
        match self.entries.remove(id) {
            Some((a, _)) => {
                self.bytes -= a.bytes() as u64;
                self.publish();
                true
            }
            None => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    fn publish(&self) {
        metrics::gauge!(m::AVATAR_CACHE_BYTES).set(self.bytes as f64);
        metrics::gauge!(m::AVATAR_CACHE_ENTRIES).set(self.entries.len() as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::media::face::{Blend, FaceBox};
    use crate::media::image::Frame;

    fn avatar(side: u32) -> Arc<Avatar> {
        let frame = Frame::new(side, side, vec![128; (side * side * 3) as usize]);
        let face = FaceBox {
            x1: 0,
            y1: 0,
            x2: side,
            y2: side,
        };
        Arc::new(Avatar::from_frame(frame, face, Blend::Feather))
    }

    #[test]
    fn least_recently_used_goes_first_when_entries_run_out() {
        let mut c = AvatarCache::new(2, u64::MAX);
        c.insert("a".into(), avatar(10)).unwrap();
        c.insert("b".into(), avatar(10)).unwrap();
        assert!(c.get("a").is_some()); // b is now the oldest
        c.insert("c".into(), avatar(10)).unwrap();
        assert!(c.contains("a") && c.contains("c") && !c.contains("b"));
    }

    #[test]
    fn the_byte_budget_is_respected() {
        let one = avatar(100).bytes() as u64;
        let mut c = AvatarCache::new(100, 2 * one + 10);
        for id in ["a", "b", "c"] {
            c.insert(id.into(), avatar(100)).unwrap();
        }
        assert_eq!(c.len(), 2);
        assert!(c.bytes() <= 2 * one + 10);
        assert!(!c.contains("a"));
        assert!(c.remove("b"));
        assert!(!c.remove("b"));
    }

    #[test]
    fn an_avatar_larger_than_the_budget_is_refused_and_evicts_nothing() {
        let one = avatar(10).bytes() as u64;
        let mut c = AvatarCache::new(10, 2 * one);
        c.insert("a".into(), avatar(10)).unwrap();
        c.insert("b".into(), avatar(10)).unwrap();
        let big = avatar(600);
        let size = big.bytes() as u64;
        assert!(size > 2 * one);
        assert_eq!(
            c.insert("x".into(), big.clone()),
            Err(NotKept::TooLarge {
                bytes: size,
                max_bytes: 2 * one
            })
        );
        // Nothing was evicted for it, and an entry with the same id is left alone.
        assert!(c.contains("a") && c.contains("b") && !c.contains("x"));
        assert_eq!(
            c.insert("a".into(), big),
            Err(NotKept::TooLarge {
                bytes: size,
                max_bytes: 2 * one
            })
        );
        assert!(c.contains("a"));
        assert_eq!(c.bytes(), 2 * one);
        let mut off = AvatarCache::new(0, u64::MAX);
        assert_eq!(off.insert("a".into(), avatar(10)), Err(NotKept::Disabled));
        assert!(off.is_empty());
    }
}
