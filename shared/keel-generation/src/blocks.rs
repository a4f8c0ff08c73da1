//! The block manager: which blocks of the paged KV pool are free, which sequences hold
//! which (reference counts, so that the n samples of a request share their prompt's
//! blocks), and the prefix cache.
//!
//! Prefix cache: a full block is keyed by the hash of its tokens and of every token before
//! it (the previous block's key), and keeps its tokens to rule out collisions. A block whose
//! last holder lets go stays cached, evictable, until its space is needed: allocation takes
//! never-cached free blocks first, then evicts the least recently used cached one. A new
//! sequence starts from the longest run of its prompt's full blocks found in the cache.
//! Refits clear the cache (keys and values of other weights must not be reused).

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use keel_model::BLOCK_SIZE;

pub type BlockId = u32;

/// The key of a full block: its tokens and the key of the block before it.
pub fn block_key(parent: Option<u64>, tokens: &[i64]) -> u64 {
    let mut hasher = DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    hasher.finish()
}

/// Keys of the full blocks of `tokens`, from `known` (keys already computed for its first
/// blocks) on.
pub fn extend_keys(known: &mut Vec<u64>, tokens: &[i64]) {
    for block in known.len()..tokens.len() / BLOCK_SIZE {
        let key = block_key(known.last().copied(), &tokens[block * BLOCK_SIZE..(block + 1) * BLOCK_SIZE]);
        known.push(key);
    }
}

#[derive(Debug, Clone)]
struct Cached {
    key: u64,
    tokens: Vec<i64>,
}

/// Counters for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefixStats {
    /// Prompt blocks looked up and found.
    pub queried: u64,
    pub hits: u64,
}

#[derive(Debug)]
pub struct BlockManager {
    refs: Vec<u32>,
    /// Free blocks that hold nothing cached (taken last-in first-out).
    free: Vec<BlockId>,
    /// What each block holds in the prefix cache.
    cached: Vec<Option<Cached>>,
    by_key: HashMap<u64, BlockId>,
    /// Cached blocks nobody holds, by when they were last let go (oldest first).
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    clock: u64,
    pub stats: PrefixStats,
}

impl BlockManager {
    pub fn new(blocks: usize) -> Self {
        Self {
            refs: vec![0; blocks],
            free: (0..blocks as BlockId).rev().collect(),
            cached: vec![None; blocks],
            by_key: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; blocks],
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that can be handed out now (free or evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks some sequence holds.
    pub fn used(&self) -> usize {
        self.total() - self.available()
    }

    /// A block for one holder, or `None` when every block is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(block) => block,
            None => {
                let (_, block) = self.evictable.pop_first()?;
                if let Some(old) = self.cached[block as usize].take() {
                    self.by_key.remove(&old.key);
                }
                block
            }
        };
        self.refs[block as usize] = 1;
        Some(block)
    }

    /// One more holder of `block`.
    pub fn share(&mut self, block: BlockId) {
        let i = block as usize;
        if self.refs[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
        }
        self.refs[i] += 1;
    }

    /// Whether more than one sequence holds `block`.
    pub fn is_shared(&self, block: BlockId) -> bool {
        self.refs[block as usize] > 1
    }

    /// One holder lets `block` go.
    pub fn release(&mut self, block: BlockId) {
        let i = block as usize;
        debug_assert!(self.refs[i] > 0, "block {block} released more often than held");
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] == 0 {
            if self.cached[i].is_some() {
                self.clock += 1;
                self.released_at[i] = self.clock;
                self.evictable.insert(self.clock, block);
            } else {
                self.free.push(block);
            }
        }
    }

    pub fn release_all(&mut self, blocks: &mut Vec<BlockId>) {
        for block in blocks.drain(..) {
            self.release(block);
        }
    }

    /// Records that `block` holds the full block `tokens` keyed `key` (the first block with
    /// a key keeps it; later copies stay uncached).
    pub fn register(&mut self, block: BlockId, key: u64, tokens: &[i64]) {
        if self.by_key.contains_key(&key) || self.cached[block as usize].is_some() {
            return;
        }
        self.by_key.insert(key, block);
        self.cached[block as usize] = Some(Cached { key, tokens: tokens.to_vec() });
    }

    /// The cached blocks holding the first full blocks of `tokens` (whose keys are `keys`),
    /// at most `limit` of them, each now held once more by the caller.
    pub fn lookup(&mut self, keys: &[u64], tokens: &[i64], limit: usize) -> Vec<BlockId> {
        let mut found = Vec::new();
        for (i, key) in keys.iter().take(limit).enumerate() {
            let Some(&block) = self.by_key.get(key) else { break };
            let same = self.cached[block as usize]
                .as_ref()
                .is_some_and(|c| c.tokens == tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
            if !same {
                break;
            }
            self.share(block);
            found.push(block);
        }
        self.stats.queried += keys.len().min(limit) as u64;
        self.stats.hits += found.len() as u64;
        found
    }

    /// Forgets every cached block (after a refit); blocks still held stay held.
    pub fn clear_cache(&mut self) {
        self.by_key.clear();
        for cached in &mut self.cached {
            *cached = None;
        }
        self.free.extend(std::mem::take(&mut self.evictable).into_values());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, salt: i64) -> Vec<i64> {
        (0..n as i64).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn shared_blocks_are_freed_by_their_last_holder() {
        let mut m = BlockManager::new(3);
        let a = m.allocate().expect("a block");
        m.share(a);
        assert!(m.is_shared(a));
        m.release(a);
        assert!(!m.is_shared(a));
        assert_eq!(m.available(), 2);
        m.release(a);
        assert_eq!(m.available(), 3);
        let all: Vec<_> = (0..3).map(|_| m.allocate().expect("a block")).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(m.allocate(), None);
    }

    #[test]
    fn cached_prefixes_are_found_until_evicted_least_recently_used_first() {
        let mut m = BlockManager::new(4);
        let prompt = tokens(2 * BLOCK_SIZE + 3, 1);
        let mut keys = Vec::new();
        extend_keys(&mut keys, &prompt);
        assert_eq!(keys.len(), 2);
        let held: Vec<_> = (0..2).map(|_| m.allocate().expect("a block")).collect();
        for (i, &block) in held.iter().enumerate() {
            m.register(block, keys[i], &prompt[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE]);
        }
        for &block in &held {
            m.release(block);
        }
        assert_eq!(m.available(), 4);
        // The same prompt finds both blocks; a prompt differing in its second block finds one.
        assert_eq!(m.lookup(&keys, &prompt, 2), held);
        let mut other = prompt.clone();
        other[BLOCK_SIZE + 1] += 1;
        let mut other_keys = Vec::new();
        extend_keys(&mut other_keys, &other);
        assert_eq!(m.lookup(&other_keys, &other, 2), held[..1]);
        assert_eq!((m.stats.queried, m.stats.hits), (4, 3));
        m.release(held[0]);
        m.release(held[0]);
        m.release(held[1]);
        // Allocation takes the never-cached blocks, then the least recently released.
        let fresh: Vec<_> = (0..3).map(|_| m.allocate().expect("a block")).collect();
        assert!(fresh.contains(&held[0]) && !fresh.contains(&held[1]), "{fresh:?} {held:?}");
        assert_eq!(m.lookup(&keys, &prompt, 2), Vec::<BlockId>::new(), "the first block was evicted");
        // A refit clears what is left.
        m.clear_cache();
        let mut again = Vec::new();
        extend_keys(&mut again, &prompt);
        assert_eq!(m.lookup(&again[1..], &prompt[BLOCK_SIZE..], 1), Vec::<BlockId>::new());
        assert_eq!(m.available(), 1);
    }
}
